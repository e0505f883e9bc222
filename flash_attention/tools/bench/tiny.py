"""``bench --tiny``: small calls whose time is the host's, not the GPU's.

At these sizes a call's kernels run for microseconds, so what a user waits for is the Python and launch path
around them (validation, the choice of kernel, the launches, autograd): the shapes where that overhead was
once larger than the kernels (docs/kernel-log.md, step 23). Their table reports microseconds per call and
the ratio of our time to each baseline's (below 1 is faster), not TFLOP/s.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .results import DEFAULT_IMPLS, OURS
from .runners import Shape

__all__ = ["TINY_SHAPES", "TinyShape", "tiny_markdown", "tiny_rows"]


@dataclass(frozen=True)
class TinyShape:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool

    def label(self) -> str:
        return (
            f"({self.batch}, {self.seqlen}, {self.heads}, {self.head_dim}){' causal' if self.causal else ''}"
        )

    def shape(self, dtype: str) -> Shape:
        return Shape(dtype, self.batch, self.heads, self.seqlen, self.head_dim, self.causal)


#: (batch, seqlen, heads, head_dim): a decoder layer of a small model, a short causal prompt, and a batch
#: of 1k-token causal sequences of a Llama-7B-sized attention.
TINY_SHAPES = (
    TinyShape(1, 128, 16, 64, False),
    TinyShape(1, 512, 16, 128, True),
    TinyShape(4, 1024, 32, 128, True),
)


def tiny_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("tiny")]


def _column(row: dict, forms: list[str]) -> str:
    """The table column of a row: the implementation, and for ours the form of repeat calls when a run
    timed several (``bench --repeat-calls``)."""
    if row["impl"] == OURS and len(forms) > 1:
        return f"{OURS} ({row.get('repeat_calls')})"
    return row["impl"]


def tiny_markdown(result: dict) -> str:
    """One table per mode: microseconds per call by shape and implementation (the median of a run's rounds,
    ``bench --rounds``), and our time over each baseline's."""
    rows = tiny_rows(result.get("rows", []))
    parts = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        forms = list(dict.fromkeys(r.get("repeat_calls") for r in mine if r["impl"] == OURS))
        shapes = list(
            dict.fromkeys(
                (r["batch"], r["seqlen"], r["heads"], r["head_dim"], bool(r["causal"])) for r in mine
            )
        )
        impls = [i for i in DEFAULT_IMPLS if any(r["impl"] == i for r in mine)]
        columns = [f"{OURS} ({f})" for f in forms] if OURS in impls and len(forms) > 1 else []
        columns = [c for i in impls for c in (columns if i == OURS and columns else [i])]
        ours = [c for c in columns if c.startswith(OURS)]
        samples: dict = {}
        for r in mine:
            key = (_column(r, forms), r["batch"], r["seqlen"], r["heads"], r["head_dim"], bool(r["causal"]))
            samples.setdefault(key, []).append(r["ms"] * 1e3)
        us = {key: statistics.median(v) for key, v in samples.items()}
        rounds = max((len(v) for v in samples.values()), default=1)
        head = ["(batch, seqlen, heads, head_dim)", "causal", *[f"{c} µs" for c in columns]]
        head += [f"{o} / {c}" for o in ours for c in columns if not c.startswith(OURS)]
        note = f", median of {rounds} rounds" if rounds > 1 else ""
        lines = [
            f"### {mode}, tiny calls ({mine[0]['dtype']}, time per call{note})",
            "",
            "| " + " | ".join(head) + " |",
        ]
        lines.append("| --- | --- | " + " | ".join("---:" for _ in head[2:]) + " |")
        for b, n, h, d, causal in shapes:
            cells = [f"({b}, {n}, {h}, {d})", "yes" if causal else "no"]
            t = {c: us.get((c, b, n, h, d, causal)) for c in columns}
            cells += [f"{t[c]:.1f}" if t[c] is not None else "–" for c in columns]
            cells += [
                f"{t[o] / t[c]:.2f}×" if t.get(o) and t[c] else "–"
                for o in ours
                for c in columns
                if not c.startswith(OURS)
            ]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + ("\n" if parts else "")

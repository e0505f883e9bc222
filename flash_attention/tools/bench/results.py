"""The result files of ``bench``: their one shape (DESIGN.md "Benchmarks"), writing, reading, finding the
newest, and merging a partial re-run into an existing file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ...spec.score_functions import SCORE_FUNCTIONS
from ..common import default_results_dir

__all__ = [
    "DEFAULT_IMPLS",
    "DEFAULT_OUTPUT",
    "KNOWN_IMPLS",
    "OURS_FP8",
    "OURS_DETERMINISTIC",
    "OURS_PLAIN_CALL",
    "OURS",
    "RESULT_KEYS",
    "ROW_KEYS",
    "load_results",
    "merged",
    "newest_results",
    "result_mode",
    "row_key",
    "write_results",
]

#: Where ``bench`` writes result files and plots without ``--output``: a folder of the current directory
#: (relative, so resolved where the command runs), never the checkout's ``benchmarks/results``, whose files
#: are committed; the repository's own results are written with ``--output benchmarks/results``.
DEFAULT_OUTPUT = Path("flash_attention_results")

#: Our implementation's name in result rows, and the baselines in the order tables list them.
OURS = "flash_attention"
#: fa4: FlashAttention-4 (flash-attn-4), skipped with the reason where it is not installed.
DEFAULT_IMPLS = (OURS, "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "fa4")
#: Ours with ``deterministic=True`` (backward modes only; not in the default sweep): the mode's cost against
#: OURS in the same run.
OURS_DETERMINISTIC = "flash_attention_deterministic"
#: Plain ``attention()`` on a decode grid's contiguous cache (``--mode decode`` only): the call of a user who
#: decodes with a loop of their own, which must be as fast as ``attention_with_kvcache`` (it may route there).
OURS_PLAIN_CALL = "flash_attention.attention"
#: Ours on FP8 inputs (not in the default sweep). ``--mode fwd``: the sweep's bf16 tensors quantized to e4m3
#: with a descale per (batch, kv head) outside the timing (spec.fp8.quantize), then attention() on them,
#: which on Hopper at head_dim 64, 128 and 256 runs the e4m3 kernel (ops.fp8_forward) and elsewhere
#: dequantizes; backward modes: attention(..., fp8=True) on the bf16 tensors, its quantizing timed with it.
#: Its rows carry dtype "fp8_e4m3" beside the bf16 rows of the same run.
OURS_FP8 = "flash_attention_fp8"
KNOWN_IMPLS = (*DEFAULT_IMPLS, OURS_DETERMINISTIC, OURS_PLAIN_CALL, OURS_FP8)

#: Keys every result file and every row has (DESIGN.md "Benchmarks"); tools read these and nothing else.
RESULT_KEYS = ("gpu", "driver", "cuda", "torch", "commit", "matmul_tflops", "rows")

ROW_KEYS = ("impl", "mode", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "ms", "tflops")


def row_key(row: dict) -> tuple:
    # (A tiny A/B's rows of one point differ by their round and their form of repeat calls. v's head_dim is
    # head_dim's where a row has none, as every row before --head-dim-v: such a row and one saying
    # head_dim_v == head_dim are the same point.)
    return (
        row["impl"], row["mode"], row["dtype"], row["head_dim"], bool(row["causal"]), row["seqlen"],
        row.get("round"), row.get("repeat_calls"), row.get("window"),
        *(row.get(name) for name in SCORE_FUNCTIONS), row.get("alibi"), row.get("sinks"),
        row.get("head_dim_v") or row["head_dim"],
    )  # fmt: skip


def _json_safe(x: Any) -> Any:
    # JSON has no NaN/Infinity; a NaN max-diff must still load in every tool, so it becomes null.
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def write_results(result: dict, path: str | os.PathLike) -> Path:
    """Write a result dict as JSON, one row per line (small git diffs), atomically (temp file + rename)."""
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"result is missing the keys {missing} that DESIGN.md requires")
    result = _json_safe(result)
    lines = []
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            items = ",\n".join("    " + json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f"  {json.dumps(key)}: [\n{items}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_results(path: str | os.PathLike) -> dict:
    """Read a result file, checking the keys DESIGN.md fixes (so a tool fails here, not deep inside)."""
    path = Path(path)
    result = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(result, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    for i, row in enumerate(result["rows"]):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} is missing keys {missing}")
    return result


def newest_results(directory: str | os.PathLike | None = None) -> Path:
    """The newest full-sweep result file in ``directory`` (default ``benchmarks/results``).

    Newest by the timestamp recorded inside (file times are meaningless after a git checkout); files of
    ``--quick`` runs are only chosen when there is nothing else.
    """
    directory = Path(directory) if directory is not None else default_results_dir()
    candidates = []
    for p in sorted(directory.glob("*.json")):
        try:
            r = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or "rows" not in r or r.get("mode") == "features":
            continue  # (a --features file's rows are one shape's features, not a sweep)
        quick = bool((r.get("settings") or {}).get("quick"))
        stamp = str(r.get("timestamp") or r.get("date") or "")
        candidates.append((not quick, stamp, p.stat().st_mtime, p.name, p))
    if not candidates:
        raise FileNotFoundError(f"no result files (*.json with rows) in {directory}")
    return max(candidates)[-1]


def merged(previous: dict | None, result: dict) -> dict:
    """``result`` with the rows of ``previous`` it did not re-measure (``--merge``)."""
    if previous is None:
        return result
    new_keys = {row_key(r) for r in result["rows"]}
    merged = dict(result)
    merged["rows"] = [r for r in previous["rows"] if row_key(r) not in new_keys] + result["rows"]
    runs = list(previous.get("merged_runs", []))
    runs.append({k: previous.get(k) for k in ("commit", "timestamp", "matmul_tflops", "torch")})
    merged["merged_runs"] = runs
    return merged


def result_mode(result: dict) -> str:
    """The mode a result file is about: ``fwd`` when it has forward rows (or none), else its training mode
    (``fwd_bwd`` before ``bwd``); ``ring`` for a ``--ring`` run, whose rows compare one GPU with several."""
    if result.get("mode") == "ring":
        return "ring"
    modes = {r.get("mode", "fwd") for r in result.get("rows", [])}
    if not modes or "fwd" in modes:
        return "fwd"
    return "fwd_bwd" if "fwd_bwd" in modes else sorted(modes)[0]

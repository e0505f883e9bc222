"""What several tools share: timing on the GPU, FLOP counts, the run's environment, where results live and
how README regions are rewritten.

:func:`time_cuda` is the one timing helper of the project: bench, autotune, demo and the progression all
time with it, so their numbers mean the same thing.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import provenance

__all__ = [
    "MODES",
    "Timing",
    "default_results_dir",
    "environment",
    "flops",
    "input_sets_needed",
    "l2_bytes",
    "measure_matmul_tflops",
    "record_provenance",
    "repo_root",
    "replace_marked_region",
    "seqlen_label",
    "time_cuda",
    "write_json",
]

MODES = ("fwd", "bwd", "fwd_bwd")

#: The matmuls of each mode by the head_dim they contract or produce, (q/k's, v's): the forward's S = Q K^T
#: (d) and O = P V (dv); the backward's S = Q K^T, dK = dS^T Q and dQ = dS K (d) and dP = dO V^T and
#: dV = P^T dO (dv). With one head_dim the backward is five matmuls against the forward's two: 2.5x, and
#: forward+backward 3.5x.
_MODE_MATMULS = {"fwd": (1, 1), "bwd": (3, 2), "fwd_bwd": (4, 3)}


def flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    causal: bool,
    mode: str = "fwd",
    window: int = 0,
    head_dim_v: int = 0,
) -> float:
    """Floating-point operations of one attention call, by the FlashAttention papers' convention.

    Forward: two matmuls (Q K^T and P V) of 2·N_q·N_k·d each per head, so 4·B·H·N_q·N_k·d. Causal keeps the
    area under the bottom-right-aligned diagonal as a continuous triangle: exactly half when N_q == N_k (the
    papers' "halved for causal", not the exact (N+1)/2N of a discrete mask), N_q·N_k - N_q²/2 when the
    queries are the last N_q positions of a longer key sequence, and N_k²/2 when N_q > N_k (the first
    N_q - N_k query rows see no key). A causal sliding window of ``window`` keys before the diagonal (N_q ==
    N_k = N >= window) keeps the band N·window - window²/2 by the same convention. Backward is 2.5x the
    forward, forward+backward 3.5x.

    ``head_dim_v``: v's own head_dim (0: head_dim). Each matmul then counts 2·N_q·N_k per head times the
    head_dim it contracts or produces: the forward 2·B·H·N_q·N_k·(d + dv), the backward 2·B·H·N_q·N_k·(3d +
    2dv) (S = Q K^T, dK and dQ over d; dP = dO V^T and dV over dv), with the same area for causal and windows.
    """
    if mode not in _MODE_MATMULS:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if window and causal and seqlen_q == seqlen_k and seqlen_q >= window:
        area = seqlen_q * window - window * window / 2
    elif causal:
        if seqlen_k >= seqlen_q:
            area = seqlen_q * seqlen_k - seqlen_q * seqlen_q / 2
        else:
            area = seqlen_k * seqlen_k / 2
    else:
        area = float(seqlen_q * seqlen_k)
    over_d, over_dv = _MODE_MATMULS[mode]
    return 2.0 * batch * heads * area * (over_d * head_dim + over_dv * (head_dim_v or head_dim))


def seqlen_label(n: int) -> str:
    # The papers' column labels: 1k, 2k, ... 16k; anything not a whole multiple of 1024 stays a number.
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _driver_version() -> str:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else "unknown"


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("fa-scratch")
    except Exception:
        return getattr(sys.modules.get("flash_attention"), "__version__", "unknown")


def record_provenance(commit: str | None = None, allow_dirty: bool = False) -> dict:
    """The ``commit`` / ``source_digest`` block of a result file (:mod:`.provenance`).

    ``commit`` is what the caller says the code is (``--commit``, for a copy without git metadata, or whose
    git metadata is older than its files, as a GPU machine's copy of a working tree can be). Where git can
    tell, a package whose sources differ from HEAD is refused (SystemExit naming the files) unless
    ``allow_dirty``; such a result is marked ``dirty`` and no README is ever generated from it. A ``commit``
    that is not the local HEAD skips that check (it would compare the files with the wrong commit): the
    result's ``source_digest`` is checked against that commit's sources when the result is used
    (:func:`.provenance.check_result`), so code that is not the commit's is still refused then.
    """
    git = provenance.git_commit()
    other_commit = (
        commit is not None and git is not None and not (git.startswith(commit) or commit.startswith(git))
    )
    dirty = [] if other_commit else provenance.dirty_sources() or []
    if dirty and not allow_dirty:
        raise SystemExit(
            "refusing to record a measurement of uncommitted code; commit first (or pass --allow-dirty for a "
            "scratch run, which no README table will accept). Changed: " + ", ".join(dirty[:10])
        )
    block: dict[str, Any] = {
        "commit": commit or git or "unknown",
        "source_digest": provenance.source_digest(),
    }
    if other_commit:
        block["git_commit"] = git  # kept beside the caller's, so a mismatch shows
    if dirty:
        block["dirty"] = True
        block["commit"] += "-dirty"
    return block


def environment(device: Any, commit: str | None = None, allow_dirty: bool = False) -> dict:
    """The metadata block of a result file for a CUDA ``device`` (provenance: :func:`record_provenance`)."""
    props = torch.cuda.get_device_properties(device)
    now = _dt.datetime.now().astimezone()
    env = {
        "gpu": torch.cuda.get_device_name(device),
        "driver": _driver_version(),
        "cuda": torch.version.cuda or "unknown",
        "torch": torch.__version__,
        **record_provenance(commit, allow_dirty),
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "flash_attention_version": _package_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    # FlashAttention-4, the bench's `fa4` baseline, where installed (None: its rows were skipped).
    env["fa4"] = _distribution_version("flash-attn-4")
    return env


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@dataclass
class Timing:
    ms: float  # median
    ms_min: float
    reps: int


def time_cuda(
    fn: Callable[[int], Any],
    n_sets: int = 1,
    *,
    warmup: int = 3,
    min_reps: int = 25,
    min_time_s: float = 0.2,
    max_reps: int = 5000,
) -> Timing:
    """Median time of ``fn(i)`` in milliseconds, measured with CUDA events on the current stream.

    ``fn(i)`` runs on input set ``i % n_sets``. Rotating sets keeps small problems from being timed out of a
    warm L2, which is not how attention runs inside a model. Every call gets its own pair of events, so the
    median discards the odd slow call (clock changes, another process) instead of averaging it in. The calls
    are queued back to back: the CPU stays ahead of the GPU for any call longer than its launch overhead, so
    the events measure GPU time; for calls shorter than their launch, the launch is what a user pays anyway.
    """
    for i in range(max(warmup, 1)):  # the first call compiles (JIT kernel, torch.compile of flex)
        fn(i % n_sets)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 3
    start.record()
    for i in range(probe):
        fn(i % n_sets)
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / probe, 1e-3)
    reps = int(min(max(min_reps, math.ceil(min_time_s * 1e3 / estimate)), max_reps))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing(statistics.median(times), min(times), reps)


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def input_sets_needed(set_bytes: int, l2_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to rotate so the data one call reads was not left in L2 by the call before.

    One set at least twice the L2 size already evicts itself; smaller ones are rotated until the sets
    together are that large, up to ``max_sets`` (beyond which launch overhead, not L2, dominates anyway).
    """
    if set_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / set_bytes)))


def measure_matmul_tflops(n: int = 8192, **timing: Any) -> float:
    """TFLOP/s of an n x n x n bf16 matmul: the tensor-core ceiling of this GPU, in this run."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda i: torch.matmul(a, b, out=c), 1, **timing)
    return 2.0 * n**3 / (t.ms * 1e-3) / 1e12


def repo_root() -> Path:
    """The checkout holding the package when it is installed editable, else the current directory."""
    root = provenance.PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").exists() else Path.cwd()


#: The page every generated benchmark region lives on (``--update-readme``'s default target); the README has
#: one headline region as well (``--readme README.md``).
PERFORMANCE_PAGE = "docs/performance.md"


def generated_by(tool: str, result_path: Path, target_path: Path) -> str:
    """The line under a generated region that says how to make it again: the command, run from the
    checkout's root, with ``--readme`` where the region is not on :data:`PERFORMANCE_PAGE`."""
    root = repo_root().resolve()

    def from_root(path: Path) -> str:
        path = path.resolve()
        return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)

    target = from_root(target_path)
    option = "" if target == PERFORMANCE_PAGE else f" --readme {target}"
    return (
        f"Generated by `python -m flash_attention {tool} --update-readme {from_root(result_path)}{option}`; "
        "do not edit by hand."
    )


def default_results_dir() -> Path:
    return repo_root() / "benchmarks" / "results"


def ready_host_library(tool: str) -> None:
    """Build (or find unavailable) the C++ host library before a tool times our calls: a first call would
    build it in the background and take the Python path meanwhile (flash_attention.jit.host), and the
    timings would then be of that path. Says so on stderr when the library cannot be had."""
    from flash_attention.jit import host

    reason = host.unavailable_reason()
    if reason is not None:
        print(
            f"{tool}: the host library is unavailable, our calls take the Python path: {reason}",
            file=sys.stderr,
        )


def replace_marked_region(readme_path: Path, begin_marker: str, end_marker: str, block: str) -> None:
    """Rewrite the text between two marker lines of a README; everything outside stays byte for byte."""
    text = readme_path.read_text(encoding="utf-8")
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin < 0 or end < 0 or end < begin:
        raise ValueError(f"{readme_path} must contain {begin_marker!r} followed by {end_marker!r}")
    new_text = text[: begin + len(begin_marker)] + "\n" + block + "\n" + text[end:]
    readme_path.write_text(new_text, encoding="utf-8")


def write_json(data: dict, path: str | os.PathLike, text: str | None = None) -> Path:
    """Write ``data`` as JSON (or ``text`` when given) atomically: a temp file beside it, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text if text is not None else json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path

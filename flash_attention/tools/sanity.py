"""``python -m flash_attention sanity``: can this machine run the kernels, and are they right?

Prints the GPU (name, compute capability, SMs, memory), the torch and CUDA versions, which compiler the JIT
will use and where its cache is, compiles (or loads) the forward and backward kernels a default
``attention()`` call picks on this GPU (on Hopper the wgmma ones) and shows the time, runs a causal training
step against float64 output and gradients with the accuracy rule of the GPU tests, and ends with PASS or
FAIL. On a machine without a
usable GPU it says exactly what is missing, checks that the CPU path works, and says what to do to get the
kernels. Every failure line says what to do next.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from flash_attention import __version__, ops
from flash_attention.api.attention import attention
from flash_attention.configs import KernelConfig, default_config
from flash_attention.configs.forward import register_roles
from flash_attention.fallback.reference import attention_reference, causal_allowed
from flash_attention.jit import compiler as _compiler
from flash_attention.jit import driver as _driver
from flash_attention.jit.cache import build, cache_dir
from flash_attention.jit.compiler import CompileError

from .sim import simulate

__all__ = ["main", "missing_gpu_reason"]

_SUPPORT = "If this persists, open an issue with this command's whole output."


class _Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def line(self, label: str, text: str) -> None:
        print(f"{label + ':':<10} {text}", flush=True)

    def fail(self, label: str, text: str, todo: str) -> None:
        self.line(label, f"FAIL: {text}")
        print(f"{'':<10} next: {todo}", flush=True)
        self.failures.append(label)


def missing_gpu_reason() -> tuple[str, str] | None:
    """None when PyTorch sees a CUDA GPU; else (what is missing, what to do about it)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"this PyTorch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None)",
            "install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu128`)",
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return (
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process",
            "unset CUDA_VISIBLE_DEVICES or list the GPUs to use (e.g. CUDA_VISIBLE_DEVICES=0)",
        )
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return (
            f"PyTorch is built for CUDA {torch.version.cuda}, but the NVIDIA driver (libcuda.so.1) is not "
            "installed or not on the loader path",
            "install the NVIDIA driver (`nvidia-smi` must work); in a container, run it with the GPU "
            "passed through (e.g. `docker run --gpus all`)",
        )
    status = lib.cuInit(0)
    if status != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"error {status}"
        todo = "check `nvidia-smi`"
        if status == 35:  # CUDA_ERROR_INSUFFICIENT_DRIVER
            todo = f"update the NVIDIA driver to one that supports CUDA {torch.version.cuda}"
        elif status == 100:  # CUDA_ERROR_NO_DEVICE
            todo = "this machine has no NVIDIA GPU the driver can see; run on a GPU machine"
        return (f"the NVIDIA driver is installed but cuInit failed: {text} ({status})", todo)
    return (
        f"PyTorch (CUDA {torch.version.cuda}) reports no usable GPU (torch.cuda.device_count() == "
        f"{torch.cuda.device_count()})",
        "check `nvidia-smi` and that this PyTorch's CUDA version is supported by the driver",
    )


def _versions(rep: _Report) -> None:

    cuda = torch.version.cuda or "none (CPU-only build)"
    rep.line(
        "versions",
        f"flash_attention {__version__}, Python {platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {cuda})",
    )


def _compiler_line(rep: _Report) -> str | None:
    kind = _compiler.choose_compiler()
    if kind is None:
        rep.fail(
            "compiler",
            "no CUDA compiler found (NVRTC from PyTorch's CUDA wheels, or nvcc from a CUDA toolkit)",
            "`pip install nvidia-cuda-nvrtc` matching your torch's CUDA major version, or install a CUDA "
            "toolkit and set CUDA_HOME (or FLASH_ATTENTION_NVCC=/path/to/nvcc)",
        )
    else:
        where = getattr(_compiler.load_nvrtc(), "_name", "?") if kind == "nvrtc" else _compiler.find_nvcc()
        forced = " (forced by FLASH_ATTENTION_COMPILER)" if os.environ.get("FLASH_ATTENTION_COMPILER") else ""
        rep.line("compiler", f"{_compiler.compiler_id(kind)} at {where}{forced}")
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".sanity-"):
            pass
        entries = len(list(root.glob("*.cubin")))
        rep.line("cache", f"{root} (writable, {entries} kernels cached)")
    except OSError as exc:
        rep.fail(
            "cache",
            f"{root} is not writable ({exc})",
            "set FLASH_ATTENTION_CACHE_DIR to a writable folder",
        )
    return kind


def _cpu_check(rep: _Report) -> None:
    """The PyTorch path of attention() on CPU tensors against the float64 reference."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 100, 2, 64, generator=gen) for _ in range(3))
    out = attention(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    err = (out.double() - ref).abs().max().item()
    if err <= 1e-5:
        rep.line("CPU path", f"PASS: attention() on CPU float32 tensors, max error {err:.2g} against float64")
    else:
        rep.fail("CPU path", f"max error {err:.3g} against float64 (expected <= 1e-5)", _SUPPORT)

    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    sim, _ = simulate(qb, kb, vb, default_config("bf16", 64, True, 100, 100), causal=True)
    ref, _ = attention_reference(qb, kb, vb, causal=True)
    err = (sim.double() - ref).abs().max().item()
    bound = _accuracy_bound(qb, kb, vb, ref)
    rule = f"(bound {bound:.3g}: 2x PyTorch's own bf16 error + 1e-5)"
    if err <= bound:
        rep.line("simulator", f"PASS: the tile simulator, bf16, max error {err:.2g} against float64 {rule}")
    else:
        rep.fail("simulator", f"max error {err:.3g} against float64 {rule}", _SUPPORT)


def _accuracy_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor) -> float:
    """The tests' accuracy rule for causal attention: 2x the error of PyTorch's own attention + 1e-5."""

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    mask = causal_allowed(q.shape[1], k.shape[1], device=q.device)
    sdpa = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    return 2 * (sdpa.double() - ref).abs().max().item() + 1e-5


def _gpu(rep: _Report, index: int) -> str | None:
    props = torch.cuda.get_device_properties(index)
    major, minor = props.major, props.minor
    driver = ""
    try:
        version = ctypes.c_int()
        _driver.libcuda().cuDriverGetVersion(ctypes.byref(version))
        driver = f", driver API {version.value // 1000}.{version.value % 1000 // 10}"
    except Exception:  # noqa: BLE001 - the driver version is informative only
        pass
    rep.line(
        "GPU",
        f"{props.name}, compute capability {major}.{minor} (sm_{major}{minor}), "
        f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB{driver}",
    )
    if major < 8:
        rep.fail(
            "GPU",
            f"the kernels need compute capability 8.0 or newer (bf16 mma.sync, cp.async); this is "
            f"{major}.{minor}",
            "attention() still works here through the PyTorch fallback; for the kernels use an "
            "A100/H100-class GPU",
        )
        return None
    return f"sm_{major}{minor}"


def _build_line(rep: _Report, label: str, cfg, arch: str, kind: str, recompile: bool) -> bool:
    """Compile (or load) one configuration and report it; False after a compile failure."""
    t0 = time.perf_counter()
    try:
        built = build(cfg, arch, kind, force=recompile)
    except CompileError as exc:
        head = "\n".join(str(exc).splitlines()[:12])
        rep.fail(
            label,
            f"{cfg.name()} for {arch} with {kind}:\n{head}",
            "try the other compiler (FLASH_ATTENTION_COMPILER=nvcc or nvrtc); " + _SUPPORT,
        )
        return False
    dt = time.perf_counter() - t0
    how = f"loaded from the cache in {dt * 1000:.0f} ms" if built.from_cache else f"compiled in {dt:.1f} s"
    resources = built.meta.get("resources") or []
    if not resources:
        # A cache entry whose compile left no ptxas report (seen once on a GPU machine whose cache other
        # processes had filled; the cause is not pinned down): the kernel is still the one the call runs.
        rep.line(label, f"{cfg.name()} for {built.arch}: {how} (no register report in its cache entry)")
        return True
    regs = max(r["registers"] for r in resources)
    spill = max(r["spill_stores"] for r in resources)
    roles = register_roles(cfg) if isinstance(cfg, KernelConfig) else ""
    regs_text = f"{regs} registers at launch; {roles}" if roles else f"up to {regs} registers"
    rep.line(label, f"{cfg.name()} for {built.arch}: {how} ({regs_text}, {spill} B spilled)")
    return True


def _sdpa_grads(q, k, v, dout):
    """PyTorch's own causal attention and its gradients, in q's precision (the accuracy rule's yardstick)."""
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_allowed(q.shape[1], k.shape[1], q.device))
    grads = torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2))
    return o.transpose(1, 2), [g.transpose(1, 2) for g in grads]


def _kernel_check(rep: _Report, index: int, arch: str, kind: str, recompile: bool) -> None:
    """Exactly what a default ``attention()`` call and its backward run on this GPU: the configurations the
    launch layer picks, compiled, then a causal training step checked against float64 gradients."""
    device = torch.device("cuda", index)
    gen = torch.Generator(device=device).manual_seed(0)
    b, s, h, d = 2, 1000, 8, 128
    q, k, v, dout = (
        torch.randn(b, s, h, d, generator=gen, device=device).to(torch.bfloat16) for _ in range(4)
    )
    fwd_cfg = ops.chosen_config(q, k, causal=True, softmax_scale=d**-0.5)
    if not _build_line(rep, "forward", fwd_cfg, arch, kind, recompile):
        return
    try:
        bwd_cfg = ops.backward_config(
            "bf16", d, True, s, s, 1, arch=arch, gpu=ops.gpu_name(index), smem_limit=ops.smem_limit(index)
        )
    except ops.NoKernel as exc:
        bwd_cfg = None
        rep.line("backward", f"the PyTorch fallback on this GPU: {exc}")
    if bwd_cfg is not None and not _build_line(rep, "backward", bwd_cfg, arch, kind, recompile):
        return

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    try:
        out = attention(*leaves, causal=True)
        grads = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any launch failure ends the check with advice
        rep.fail("run", f"the kernels failed to run: {exc}", _SUPPORT)
        return
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    sdpa, sdpa_grads = _sdpa_grads(q, k, v, dout)
    checks = [("out", out, sdpa, ref)] + list(
        zip(("dq", "dk", "dv"), grads, sdpa_grads, ref_grads, strict=True)
    )
    worst = []
    for name, got, theirs, exact in checks:
        err = (got.double() - exact).abs().max().item()
        bound = 2 * (theirs.double() - exact).abs().max().item() + 1e-5
        worst.append((err / bound if math.isfinite(err) else math.inf, name, err, bound))
    ratio, name, err, bound = max(worst)
    what = f"causal training step on ({b}, {s}, {h}, {d}) bf16, output and gradients against float64"
    detail = f"worst: {name} max error {err:.3g} (bound {bound:.3g}: 2x PyTorch's own error + 1e-5)"
    if ratio <= 1.0:
        rep.line("run", f"PASS: {what}; {detail}")
    else:
        rep.fail(
            "run",
            f"{what}; {detail}",
            "run `python -m pytest -m gpu tests/test_gpu_forward.py tests/test_gpu_autograd.py` and "
            "`python -m flash_attention debug --config default --seqlen 256` to locate the fault; "
            + _SUPPORT,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attention sanity",
        description="Check that this machine can compile and run the kernels, and that they are correct.",
    )
    ap.add_argument("--require-gpu", action="store_true", help="exit 1 when no usable GPU is found")
    ap.add_argument("--recompile", action="store_true", help="compile the test kernel even if it is cached")
    ap.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    args = ap.parse_args(argv)

    rep = _Report()
    _versions(rep)
    missing = missing_gpu_reason()
    arch = None
    if missing is not None:
        what, todo = missing
        rep.line("GPU", f"none usable: {what}")
        print(f"{'':<10} next: {todo}")
    else:
        arch = _gpu(rep, args.device)
    kind = _compiler_line(rep)
    _cpu_check(rep)
    if arch is not None and kind is not None:
        _kernel_check(rep, args.device, arch, kind, args.recompile)

    if rep.failures:
        print(f"FAIL ({', '.join(dict.fromkeys(rep.failures))}): see the 'next:' lines above")
        return 1
    if missing is not None:
        print(
            "NO GPU: the CPU path works (attention() on CPU tensors, the simulator, `build` for "
            "ahead-of-time compiles); the CUDA kernels need what the GPU line says is missing"
        )
        return 1 if args.require_gpu else 0
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

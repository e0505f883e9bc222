"""Host time of attention() and attention_with_kvcache() calls on a machine without a GPU: the launch
layer's Python and the host library run as they do on a GPU, with no-op stand-ins for the kernels, the
tensor maps and the driver.

The number is the host's share of a small call (where the host's time is the whole time), without the driver
calls themselves (a launch and a context query cost a few microseconds more each on a GPU host). The
stand-in driver is a C function that returns 0 and does nothing (built here with the C compiler), called by
the host library for its launches and context queries, and from Python through the real ctypes paths
(``jit.driver``'s cuLaunchKernel and context calls with their declared argument types), so both forms of a
call pay what their own calls into the driver cost, less the driver's own work. It is for
comparing versions of the host path on one machine, never for comparing with a GPU's figures.

    python tools/host_time_cpu.py                 # the tiny shapes of `bench --tiny`
    python tools/host_time_cpu.py --profile       # and cProfile's top entries of the training step (and of
                                                  # the e4m3 forward)
    python tools/host_time_cpu.py --whole-path    # every call takes the whole path (no repeat calls, as
                                                  # FLASH_ATTENTION_REPEAT_CALLS=0 does)
    python tools/host_time_cpu.py --mode native   # repeat calls in the host library (=native)
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import flash_attention as fa
from flash_attention import ops
from flash_attention.jit import driver, host
from flash_attention.ops import backward, decode, dispatch, forward, plans, repeat, tma


def _noop_library() -> ctypes.CDLL:
    """A shared library with ``int fa_noop(void)`` returning 0 (callers' extra arguments are ignored by the C
    calling convention), built once into a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="fa_noop_"))
    (folder / "noop.c").write_text("int fa_noop(void) { return 0; }\n")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("host_time_cpu.py needs a C compiler for its no-op driver")
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", str(folder / "noop.c"), "-o", str(folder / "noop.so")], check=True
    )
    return ctypes.CDLL(str(folder / "noop.so"))


_LIBRARY = _noop_library()
_NOOP = _LIBRARY.fa_noop


def _noop_as(argtypes) -> ctypes._CFuncPtr:
    """The no-op with a driver entry point's declared argument types (a fresh function object each)."""
    fn = _LIBRARY["fa_noop"]
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_FACTS = {"arch": "sm_90", "gpu": "NVIDIA H100 80GB HBM3", "smem_limit": 227 * 1024}


class _Kernel(driver.Kernel):
    """driver.Kernel, launching (through its own ctypes path) into the no-op; no attribute calls."""

    def __init__(self):
        super().__init__(None, ctypes.c_void_p(0x1234), "stand_in")

    def ensure_dynamic_smem(self, nbytes, index):
        pass

    def blocks_per_sm(self, threads, smem, index):
        return 2


class _Kernels(dict):
    def __missing__(self, key):
        return _Kernel()


def install_stand_ins():
    """Send attention() on bf16 CPU tensors down an H100's kernel path, with no-op kernels and driver."""
    dispatch.wants_kernel = lambda q: True
    ops.cuda_unavailable_reason = lambda q: None
    for module in (forward, backward):
        module.device_facts = lambda index: _FACTS
        module.device_arch = lambda index: "sm_90"
        module.current_stream = lambda index: 0
    forward.sm_count = decode.sm_count = lambda index: 132
    decode.device_arch = lambda index: "sm_90"
    decode.current_stream = lambda index: 0
    decode.cuda_unavailable_reason = lambda q: None
    decode.get_decode_kernels = lambda *a, **kw: _Kernels()
    decode._capturing = lambda device: False
    forward.get_kernel = lambda *a, **kw: _Kernel()
    backward.get_bwd_kernels = lambda *a, **kw: _Kernels()
    tma.encode_into = lambda field, layout, address, **kw: 0  # (kw: the e4m3 maps' one_byte)
    plans.current_stream = lambda index: 0
    # The Python launches' own ctypes calls, into the no-op: cuLaunchKernel with its argument types, and
    # make_primary_current's context query and switch.
    launch = _noop_as([ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3)
    driver._launch_kernel = lambda: launch
    driver._launch_kernel_ex = lambda: None  # (programmatic launches then go through cuLaunchKernel)
    context = (_noop_as([ctypes.POINTER(ctypes.c_void_p)]), _noop_as([ctypes.c_void_p]))
    driver._ctx_functions = lambda: context
    driver.primary_context = lambda index: 0xC0FFEE
    lib = host.load(connect_driver=False)
    # The launches and context calls: a C function that returns 0 (its arguments ignored); the encode, called
    # once per new address triple, a Python stand-in.
    noop = ctypes.cast(_NOOP, ctypes.c_void_p).value
    encode = host.DRIVER_FUNCTION_TYPES[4](lambda *a: 0)
    lib.set_driver(noop, noop, noop, 0, ctypes.cast(encode, ctypes.c_void_p).value, noop)
    host.ops_or_none = lambda: lib
    return encode  # the callback must outlive every call


def host_us(fn, n=2000, reps=7) -> tuple[float, float]:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples), min(samples)


def measure(b: int, s: int, h: int, d: int, causal: bool, profile: bool) -> None:
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, s, h, d, dtype=torch.bfloat16)
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def step():
        out = fa.attention(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), g)

    assert fa.attention(q, k, v, causal=causal).grad_fn.name() == "FlashAttentionBackward"
    print(f"({b}, {s}, {h}, {d}) causal={causal}: host µs per call, median (min) of 7 x 2000")
    for name, fn in (
        ("training step", step),
        ("forward, recording", lambda: fa.attention(q, k, v, causal=causal)),
        ("forward, inference", lambda: fa.attention(qd, kd, vd, causal=causal)),
    ):
        median, low = host_us(fn)
        print(f"  {name:20s} {median:7.1f} ({low:.1f})")
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3000):
            step()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        print(text.getvalue())


def measure_decode() -> None:
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 1024, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 1, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([500], dtype=torch.int32)
    print("decode (1, 1, 32/8, 128), 1k cache: host µs per call, median (min) of 7 x 2000")
    with torch.no_grad():

        def one(new=None):
            return fa.attention_with_kvcache(q, k_cache, v_cache, *(new or ()), cache_seqlens=lengths)

        # attention() itself on the same tensors: a few queries per row go to the same decode kernels
        # (flash_attention.api.few_queries), the cache read whole (1k keys).
        routed = (
            ("one token", one),
            ("one token, appended", lambda: one((k, v))),
            ("attention(), one query", lambda: fa.attention(q, k_cache, v_cache, causal=True)),
        )
        for name, fn in routed:
            median, low = host_us(fn)
            print(f"  {name:22s} {median:7.1f} ({low:.1f})")


def measure_varlen_decode() -> None:
    """A decoding step through attention_varlen (8 sequences of one query each against 1k-4k keys, 32/8 x
    128, causal, as a serving loop packs it: the decode kernels' route, api.few_queries.route_varlen) beside
    attention_with_kvcache on the same keys laid out as a cache (kernel log 129)."""
    lengths = [1000, 4000, 2000, 3000, 1500, 2500, 1200, 3800]
    n = len(lengths)
    q = torch.randn(n, 32, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 8, 128, dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.arange(n + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kc, vc = (torch.randn(n, max(lengths), 8, 128, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor(lengths, dtype=torch.int32)
    hints = dict(max_seqlen_q=1, max_seqlen_k=max(lengths), causal=True)
    print(
        "decoding step, 8 sequences of 1k-4k keys (32/8, 128) causal: host µs per call, median (min) of 7 x "
        "2000"
    )
    with torch.no_grad():
        for name, fn in (
            ("attention_varlen", lambda: fa.attention_varlen(q, k, v, cu_q, cu_k, **hints)),
            (
                "attention_with_kvcache",
                lambda: fa.attention_with_kvcache(q[:, None], kc, vc, cache_seqlens=lens),
            ),
        ):
            median, low = host_us(fn)
            print(f"  {name:22s} {median:7.1f} ({low:.1f})")


def measure_packed() -> None:
    """attention_varlen on a packed batch of three sequences (1,024 tokens, 16 x 128, causal), inference and
    a training step (kernel-log step 107)."""
    lengths = [300, 512, 212]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 16, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    hints = dict(max_seqlen_q=512, max_seqlen_k=512, causal=True)

    def step():
        out = fa.attention_varlen(q, k, v, cu, cu, **hints)
        return torch.autograd.grad(out, (q, k, v), g)

    print("packed (3 sequences, 1024 tokens, 16, 128) causal: host µs per call, median (min) of 7 x 500")
    for name, fn in (
        ("training step", step),
        ("forward, inference", lambda: fa.attention_varlen(qd, kd, vd, cu, cu, **hints)),
    ):
        median, low = host_us(fn, n=500)
        print(f"  {name:20s} {median:7.1f} ({low:.1f})")


def measure_window_sinks() -> None:
    """A training step of gpt-oss's sliding layers (window (128, 0), learnable sinks), and the same without
    the sinks: with short windows the kernels' time is small and the host's shows (kernel log, host)."""
    q, k, v = (torch.randn(1, 1024, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(16, requires_grad=True)
    g = torch.randn_like(q)
    print("(1, 1024, 16, 64) causal, window (128, 0): host µs per call, median (min) of 7 x 2000")
    for name, extra, leaves in (
        ("training step", {}, (q, k, v)),
        ("with sinks", {"sinks": sinks}, (q, k, v, sinks)),
    ):

        def step(extra=extra, leaves=leaves):
            out = fa.attention(q, k, v, causal=True, window=(128, 0), **extra)
            return torch.autograd.grad(out, leaves, g)

        median, low = host_us(step)
        print(f"  {name:20s} {median:7.1f} ({low:.1f})")


def measure_fp8(profile: bool) -> None:
    """The e4m3 forward's host path (ops.fp8_forward.cuda_forward_e4m3: descales, V^T's launch, params, three
    tensor maps, the launch) on e4m3 CPU tensors taken for CUDA ones (issue 51: short causal calls' wall
    time was twice their kernels')."""
    from flash_attention.ops import fp8_forward, fp8_values

    fp8_forward.get_kernel = lambda *a, **kw: _Kernel()
    fp8_forward.device_arch = fp8_values.device_arch = lambda index: "sm_90"
    fp8_forward.sm_count = lambda index: 132
    fp8_values.device_unavailable_reason = lambda index: None
    fp8_values.get_values_transpose_kernels = lambda cfg, arch: _Kernels()
    is_cuda = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: True)  # (the checks of "a CUDA tensor" only)
    try:
        print("e4m3 forward (cuda_forward_e4m3) d128: host µs per call, median (min) of 7 x 1000")
        for b, s, h, causal in ((1, 512, 16, True), (4, 1024, 16, True), (4, 1024, 16, False)):
            q, k, v = (torch.randn(b, s, h, 128).to(torch.float8_e4m3fn) for _ in range(3))
            scales = torch.full((1,), 0.5)
            for name, descales in (("no descales", (None,) * 3), ("descales", (scales,) * 3)):

                def call(q=q, k=k, v=v, causal=causal, descales=descales):
                    return fp8_forward.cuda_forward_e4m3(
                        q, k, v, causal=causal, q_descale=descales[0], k_descale=descales[1],
                        v_descale=descales[2],
                    )  # fmt: skip

                median, low = host_us(call, n=1000)
                print(f"  ({b}, {s}, {h}) causal={causal!s:5s} {name:12s} {median:7.1f} ({low:.1f})")
            if profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(2000):
                    fp8_forward.cuda_forward_e4m3(q, k, v, causal=causal)
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
                print(text.getvalue())
                profile = False
    finally:
        torch.Tensor.is_cuda = is_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--whole-path", action="store_true", help="no repeat calls")
    parser.add_argument(
        "--mode", choices=("python", "native"), default="python", help="the repeat calls' form"
    )
    args = parser.parse_args()
    # One intra-op thread: the few ATen operations a step runs on the host's tensors here (the sinks'
    # gradient: four, on the GPU four launches) would otherwise measure the thread pool's wake-ups (about
    # 0.5 ms a step on a 2-core machine), not the host path.
    torch.set_num_threads(1)
    keep = install_stand_ins()  # noqa: F841
    repeat.MODE = "off" if args.whole_path else args.mode
    for shape in [(1, 128, 16, 64, False), (1, 512, 16, 128, True), (4, 1024, 32, 128, True)]:
        measure(*shape, profile=args.profile)
    measure_decode()
    measure_varlen_decode()
    measure_packed()
    measure_window_sinks()
    measure_fp8(args.profile)


if __name__ == "__main__":
    main()

"""Host time of attention() calls on a machine without a GPU: the launch layer's Python and the compiled
training node run as they do on a GPU, with no-op stand-ins for the kernels, the tensor maps and the driver.

The number is the host's share of a small call (where the host's time is the whole time), without the driver
calls themselves (a launch and a context query cost a few microseconds more each on a GPU host). It is for
comparing versions of the host path on one machine, never for comparing with a GPU's figures.

    python tools/host_time_cpu.py                 # the tiny shapes of `bench --tiny`
    python tools/host_time_cpu.py --profile       # and cProfile's top entries of the training step
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
import statistics
import time

import torch

import flash_attention as fa
from flash_attention import dispatch, ops
from flash_attention.jit import driver, host
from flash_attention.ops import backward, forward, plans, repeat, tma, training

_LIBC = ctypes.CDLL(None)
_FACTS = {"arch": "sm_90", "gpu": "NVIDIA H100 80GB HBM3", "smem_limit": 227 * 1024}


class _Kernel:
    class handle:  # noqa: N801 - the attribute driver.Kernel has
        value = 0x1234

    name = "stand_in"

    def ensure_dynamic_smem(self, nbytes, index):
        pass

    def launch(self, grid, block, smem, stream, params):
        _LIBC.getpid()  # one foreign call, as the driver launch is


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
    forward.sm_count = lambda index: 132
    forward.get_kernel = lambda *a, **kw: _Kernel()
    backward.get_bwd_kernels = lambda *a, **kw: _Kernels()
    tma.encode_into = lambda field, layout, address: 0
    plans.current_stream = lambda index: 0
    driver.make_primary_current = lambda index: None
    driver.primary_context = lambda index: 0xC0FFEE
    lib = host.load(connect_driver=False)

    def get(out):
        out[0] = 0xC0FFEE
        return 0

    keep = host.set_stand_in_driver(
        lib, lambda *a: 0, get, lambda ctx: 0, lambda status, text: 0, lambda *a: 0
    )
    training.host_ops = lambda: lib
    return keep  # the callbacks must outlive every call


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--whole-path", action="store_true", help="no repeat calls")
    parser.add_argument(
        "--mode", choices=("python", "native"), default="python", help="the repeat calls' form"
    )
    args = parser.parse_args()
    keep = install_stand_ins()  # noqa: F841
    repeat.MODE = "off" if args.whole_path else args.mode
    for shape in [(1, 128, 16, 64, False), (1, 512, 16, 128, True), (4, 1024, 32, 128, True)]:
        measure(*shape, profile=args.profile)


if __name__ == "__main__":
    main()

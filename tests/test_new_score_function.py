"""What a new score function costs: two edits, and every layer has it.

The test copies the package, adds a toy scalar score function ("tilt": s -> s + b s^2 / 8 on the scaled
score, smooth, with its own derivative) as one entry of the registry (spec/score_functions.py: its name,
policy, math, slope and the kernels' arithmetic for the simulator) and one C++ policy (fa/variant.cuh), and
nothing else; then, in a process that imports the copy, checks that each layer has it: the build's name and
policy, the configuration features every kernel family takes, the kernels of every family compiled with it
(portable forward and backward, the warp-specialized forward, the warp-specialized backwards at head_dim 128
and 256, the wide backward), the launch layer's spec, the PyTorch fallback's forward and backward and the
float64 reference against an independent computation of the same math, and the simulator. A layer that
named its score functions one by one would fail it (issue 50: a toy through the spec and one policy in at
most 6 files).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flash_attention
from flash_attention.jit import compiler

#: The registry entry: name, policy, the math in the scores' dtype, its slope from the output, a doc, and
#: the kernels' float32 arithmetic (folded: on unscaled scores, in the same units).
_ENTRY = """
    "tilt": ScoreFunction(
        "tilt",
        "Tilt",
        lambda s, b: s + b * s * s / 8,
        lambda out, b: (1 + b * out / 2).clamp(min=0).sqrt(),
        "tilts the scaled score, s + tilt * s^2 / 8",
        lambda s, b, scale, folded: (s + (_f32(b / 8 * scale) if folded else _f32(b / 8)) * s * s).float(),
    ),
"""

#: The policy (fa/variant.cuh's interface: the function, its folded form, its derivative from its output).
_POLICY = """
// A test's toy (tests/test_new_score_function.py): s' = s + b s^2 / 8, derivative sqrt(1 + b s' / 2).
struct Tilt {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGradient = false;
  float b8, b8_scale;
  template <class Params>
  __device__ __forceinline__ Tilt(const Params& p, int /*batch*/, int /*head*/)
      : b8(p.score_values[0] * 0.125f), b8_scale(p.score_values[0] * 0.125f * p.scale) {}
  __device__ __forceinline__ float operator()(float s, int, int) const { return fmaf(b8 * s, s, s); }
  __device__ __forceinline__ float folded(float s, float /*rel*/) const { return fmaf(b8_scale * s, s, s); }
  __device__ __forceinline__ int diagonal(int q) const { return q; }
  __device__ __forceinline__ float gradient(float s_mod, int /*q*/, int /*k*/) const {
    return sqrtf(fmaxf(fmaf(4.f * b8, s_mod, 1.f), 0.f));
  }
};
"""

_CHECKS = textwrap.dedent(
    """
    import torch

    from flash_attention.configs import default_bwd_config, default_config, hopper_bwd_config, supports
    from flash_attention.fallback.reference import (
        attention_backward_torch, attention_reference, attention_torch,
    )
    from flash_attention.jit import cache, sources
    from flash_attention.ops.plans import kernel_build, launch_spec
    from flash_attention.spec import ScoreSpec
    from flash_attention.tools.sim import simulate

    B = 0.3  # (the slope's square root needs s > -4 / B: the scores below stay above -13)
    spec = ScoreSpec.of(tilt=B)
    assert (spec.build, spec.policy, spec.features["tilt"]) == ("tilt", "fa::Tilt", True), spec
    assert sources.SCORE_MODS["tilt"] == "fa::Tilt"

    # The launch layer's spec and build of a call given the toy by name.
    q = torch.randn(1, 70, 4, 64, dtype=torch.float64) * 1.5
    k, v = (torch.randn(1, 90, 2, 64, dtype=torch.float64) * 1.5 for _ in range(2))
    call = launch_spec(q.to(torch.bfloat16), True, 0.125, None, None, None, 0.0, tilt=B)
    assert call.score == spec and kernel_build(call, 70, 90).score == "tilt"

    # Every family that takes score functions takes the toy, and its build compiles.
    units = [
        (default_config("bf16", 128, False, 1024, 1024, "sm_80"), "sm_80"),
        (default_bwd_config("bf16", 128, "sm_80"), "sm_80"),
        (default_config("bf16", 128, False, 4096, 4096, "sm_90a"), "sm_90a"),
        (default_bwd_config("bf16", 128, "sm_90a"), "sm_90a"),
        (default_bwd_config("bf16", 256, "sm_90a"), "sm_90a"),
        (hopper_bwd_config("bf16", 256, warp_specialized=False), "sm_90a"),
    ]
    for cfg, arch in units:
        assert supports(cfg, "tilt"), cfg
        built = cache.build(cfg, arch, score="tilt")
        # (a backward's unit also holds its preprocessing and conversion kernels, which no score reaches)
        names = [r["kernel"] for r in built.meta["resources"]]
        names = [n for n in names if not n.endswith(("__pre", "__convert"))]
        assert names and all(n.endswith("__tilt") for n in names), names

    # The PyTorch paths against the toy's math written out here (float64).
    def explicit(q, k, v, causal):
        g = q.shape[2] // k.shape[2]
        kk, vv = (t.repeat_interleave(g, dim=2) for t in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.125
        s = s + B * s * s / 8
        if causal:
            keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2])
            s = s.masked_fill(~keep, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv), s.logsumexp(-1)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = explicit(*leaves, True)
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(want, leaves, dout)
    ref, ref_lse = attention_reference(q, k, v, causal=True, softmax_scale=0.125, tilt=B)
    assert torch.allclose(ref, want, atol=1e-12) and torch.allclose(ref_lse, want_lse, atol=1e-12)
    got, lse = attention_torch(q, k, v, causal=True, softmax_scale=0.125, return_lse=True, tilt=B)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(lse.double(), want_lse, atol=1e-6)
    back = attention_backward_torch(dout, q, k, v, got, lse, causal=True, softmax_scale=0.125, tilt=B)
    for mine, exact in zip(back, grads):
        assert torch.allclose(mine, exact, atol=1e-6), (mine - exact).abs().max()
    plain, _ = attention_torch(q, k, v, causal=True, softmax_scale=0.125, return_lse=True)
    assert (plain - want).abs().max() > 1e-3  # (the toy changed the result)

    # The simulator (its kernel form) on the portable forward, against the same math.
    cfg = default_config("bf16", 64, True, 128, 128, "sm_80")
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    sim, _ = simulate(qb, kb, vb, cfg, causal=True, softmax_scale=0.125, tilt=B)
    sim_plain, _ = simulate(qb, kb, vb, cfg, causal=True, softmax_scale=0.125)
    exact, _ = explicit(*(t.double() for t in (qb, kb, vb)), True)
    err, moved = (sim.double() - exact).abs().max(), (sim - sim_plain).double().abs().max()
    print(f"simulator: error {err:.3g}, the toy moved it {moved:.3g}")
    assert err < 0.05 and moved > 0.5  # (a few bf16 ulps of outputs of about 4; the toy moves them by ~1)

    # The bench: an option of its own, a row of bench --features, FlexAttention's score_mod from its math.
    from flash_attention.tools.bench import cli as bench_cli
    from flash_attention.tools.bench.features import FEATURES
    from flash_attention.tools.bench.runners import Shape, _flex_score_mod, _variant_args
    from flash_attention.spec.score_functions import SCORE_FUNCTIONS

    assert bench_cli.build_parser().parse_args(["--tilt", "0.5"]).tilt == 0.5 and "tilt" in FEATURES
    shape = Shape("bf16", 1, 1, 8, 16, False, score=(("tilt", B),))
    assert _variant_args(shape)["tilt"] == B
    s = torch.randn(8, 8, dtype=torch.float64)
    assert torch.equal(_flex_score_mod(shape, "cpu")(s, 0, 0, 0, 0), SCORE_FUNCTIONS["tilt"].apply(s, B))
    print("every layer has the toy")
    """
)


@pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")
def test_a_new_score_function_is_two_edits(tmp_path):
    package = Path(flash_attention.__file__).parent
    copy = tmp_path / "flash_attention"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))

    registry = copy / "spec" / "score_functions.py"
    text = registry.read_text()
    head, sep, tail = text.partition("SCORE_FUNCTIONS: dict[str, ScoreFunction] = {")
    body, close, rest = tail.partition("\n}\n")
    assert sep and close, "the registry's table is no longer one dict literal"
    registry.write_text(head + sep + body + _ENTRY.rstrip("\n") + close + rest)

    variant = copy / "csrc" / "include" / "fa" / "variant.cuh"
    text = variant.read_text()
    anchor = "// Where ALiBi's distance is measured from"
    assert anchor in text
    variant.write_text(text.replace(anchor, _POLICY.lstrip("\n") + "\n" + anchor, 1))

    edited = {
        str(p.relative_to(copy))
        for p in copy.rglob("*")
        if p.is_file() and p.read_bytes() != (package / p.relative_to(copy)).read_bytes()
    }
    assert edited == {"spec/score_functions.py", "csrc/include/fa/variant.cuh"}

    env = {"PYTHONPATH": str(tmp_path), "FLASH_ATTENTION_CACHE_DIR": str(tmp_path / "cache")}
    env["FLASH_ATTENTION_HOST_LIBRARY"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", f"import flash_attention; assert flash_attention.__file__.startswith("
         f"{str(tmp_path)!r}), flash_attention.__file__\n{_CHECKS}"],
        capture_output=True, text=True, timeout=600, env={**_inherited(), **env}, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "every layer has the toy" in proc.stdout, proc.stdout
    print(proc.stdout.splitlines()[-2])


def _inherited() -> dict:
    keep = ("PATH", "HOME", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "TMPDIR", "FLASH_ATTENTION_QUIET")
    return {name: os.environ[name] for name in keep if name in os.environ}

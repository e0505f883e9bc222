"""bench --head-dim-v on the CPU: v (the output and dO) with its own head_dim while q and k keep --head-dims
(DeepSeek's MLA prefill: 192/128), from the command line through the sweep's shapes, the runners, the FLOP
count and the max-diff check into the result rows; a head_dim under v's and an implementation that takes no v
of its own are skipped with the reason. The sweep itself runs on CPU tensors here, with its timing, device
and environment stood in (the kernels' rows need a GPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flash_attention.tools import bench
from flash_attention.tools.bench import runners, sweep
from flash_attention.tools.bench.cli import build_parser, sweep_tag
from flash_attention.tools.bench.results import DEFAULT_IMPLS, OURS, load_results, merged, row_key
from flash_attention.tools.bench.runners import Runner, Shape, Skip, make_inputs, make_runner
from flash_attention.tools.bench.sweep import SweepSettings, run_sweep, sweep_shapes
from flash_attention.tools.common import flops

# ------------------------------------------------------------------------------------------------
# The command line


def test_cli_parses_head_dim_v():
    assert build_parser().parse_args(["--head-dims", "192", "--head-dim-v", "128"]).head_dim_v == 128
    assert build_parser().parse_args([]).head_dim_v == 0  # (without it: v has q's head_dim)
    for bad in ("0", "-64", "abc", "1k"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["--head-dim-v", bad])
        assert e.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [["--tiny"], ["--mode", "decode"], ["--mode", "model"], ["--varlen"], ["--progression"], ["--ring"]]
    + [["--device", "cpu"], ["--dtype", "fp32"]],
)
def test_head_dim_v_is_refused_outside_the_sweep(argv, capsys):
    """Modes with shapes of their own would ignore it silently; they refuse it before anything runs."""
    assert bench.main([*argv, "--head-dim-v", "128", "--no-save"]) == 2
    assert "--head-dim-v goes with the CUDA sweep" in capsys.readouterr().err


def test_result_file_name_says_dv():
    assert sweep_tag(None, 128) == "dv128"
    assert sweep_tag("quick", 64) == "dv64-quick"
    assert sweep_tag("mla", 0) == "mla" and sweep_tag(None, 0) is None


# ------------------------------------------------------------------------------------------------
# Shapes, inputs, dO and FLOPs


def test_sweep_shapes_give_v_its_own_head_dim_and_heads_follow_q():
    s = SweepSettings(
        impls=(OURS,), seqlens=(1024, 4096), head_dims=(192, 128), causal=(True,), head_dim_v=128
    )
    shapes = sweep_shapes(s)
    assert [(x.head_dim, x.dv, x.heads, x.batch) for x in shapes] == [
        (192, 128, 2048 // 192, 16),
        (192, 128, 2048 // 192, 4),
        (128, 128, 16, 16),
        (128, 128, 16, 4),
    ]
    # Without --head-dim-v a shape's v has its head_dim (and records none).
    (plain,) = sweep_shapes(SweepSettings(impls=(), seqlens=(512,), head_dims=(64,), causal=(False,)))
    assert plain.head_dim_v == 0 and plain.dv == 64


@pytest.mark.parametrize(("d", "dv"), [(192, 128), (128, 64), (64, 32)])
def test_inputs_build_v_with_its_own_columns(d, dv):
    shape = Shape("bf16", 2, 4, 24, d, True, kv_heads=2, head_dim_v=dv)
    ((q, k, v), (q1, _, _)) = make_inputs(shape, 2, "cpu")
    assert q.shape == (2, 24, 4, d) and k.shape == (2, 24, 2, d) and v.shape == (2, 24, 2, dv)
    assert not torch.equal(k[..., :dv], v) and not torch.equal(q, q1)  # fresh random data everywhere


@pytest.mark.parametrize("mode", ["bwd", "fwd_bwd"])
def test_backward_modes_take_d_o_with_v_s_columns(mode):
    """The timed backward's output gradient has the output's shape: v's head_dim, not q's."""
    shape = Shape("bf16", 1, 2, 16, 32, False, head_dim_v=16)
    inputs = [tuple(t.float() for t in s) for s in make_inputs(shape, 2, "cpu")]
    seen: list = []

    def f(q, k, v):
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        out.register_hook(lambda g: seen.append(tuple(g.shape)))
        return out

    dq, dk, dv = runners._autograd_call(f, inputs, mode)(1)
    assert seen == [(1, 16, 2, 16)]
    assert dq.shape == dk.shape == (1, 16, 2, 32) and dv.shape == (1, 16, 2, 16)


def test_flops_count_v_s_head_dim():
    """By hand, b=2, h=3, N=1024, d=192, dv=128: the forward's Q K^T and P V are 2·b·h·N²·d and 2·b·h·N²·dv;
    the backward's S, dK, dQ over d and dP, dV over dv: 2·b·h·N²·(3·192 + 2·128)."""
    assert flops(2, 3, 1024, 1024, 192, False, "fwd", head_dim_v=128) == 4_026_531_840  # 12·2^20·320
    assert flops(2, 3, 1024, 1024, 192, True, "fwd", head_dim_v=128) == 2_013_265_920
    assert flops(2, 3, 1024, 1024, 192, False, "bwd", head_dim_v=128) == 10_468_982_784  # 12·2^20·832
    assert flops(2, 3, 1024, 1024, 192, True, "bwd", head_dim_v=128) == 5_234_491_392
    assert flops(2, 3, 1024, 1024, 192, False, "fwd_bwd", head_dim_v=128) == 14_495_514_624
    # 128/64 with a causal window of 256 keys: the band N·W - W²/2 of each product.
    band = 1024 * 256 - 256 * 256 / 2
    assert flops(1, 1, 1024, 1024, 128, True, "fwd_bwd", 256, 64) == 2 * band * (4 * 128 + 3 * 64)
    # v with q's head_dim is the plain count, in every mode.
    for mode in ("fwd", "bwd", "fwd_bwd"):
        for causal in (False, True):
            assert flops(2, 8, 2048, 2048, 128, causal, mode, head_dim_v=128) == flops(
                2, 8, 2048, 2048, 128, causal, mode
            )


# ------------------------------------------------------------------------------------------------
# Skips


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_v_wider_than_q_is_skipped_by_every_implementation(mode):
    shape = Shape("bf16", 1, 2, 32, 64, True, head_dim_v=128)
    inputs = make_inputs(shape, 1, "cpu")
    for impl in DEFAULT_IMPLS:
        with pytest.raises(Skip, match=r"v's head_dim \(128\) is wider than q's and k's \(64\)"):
            make_runner(impl, shape, inputs, mode)


def test_sdpa_flash_refuses_v_of_its_own_head_dim():
    shape = Shape("bf16", 1, 2, 32, 128, False, head_dim_v=64)
    with pytest.raises(Skip, match="FlashAttention-2 requires one head_dim"):
        make_runner("sdpa_flash", shape, make_inputs(shape, 1, "cpu"), "fwd")


def test_config_rows_skip_v_of_its_own_head_dim(monkeypatch):
    """--config runs flash_attention.forward(), which refuses v of its own head_dim: skipped, not failed."""
    from flash_attention import configs

    monkeypatch.setattr(runners.ops, "cuda_unavailable_reason", lambda q: None)
    cfg = configs.default_config("bf16", 192, False, 1024, 1024)
    shape = Shape("bf16", 1, 2, 32, 192, False, head_dim_v=128)
    with pytest.raises(Skip, match="takes no v of its own head_dim"):
        make_runner(OURS, shape, make_inputs(shape, 1, "cpu"), "fwd", cfg.name())


# ------------------------------------------------------------------------------------------------
# The sweep, end to end on CPU tensors


def _math(q, k, v, causal):
    """SDPA's math path in our layout (it takes v's own head_dim, Ev != E)."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
    return out.transpose(1, 2)


MS = 1e-9  # every stood-in timing, in ms: TFLOP/s is then the FLOP count itself (rows round to 0.01)


@pytest.fixture
def cpu_sweep(monkeypatch):
    """run_sweep on CPU tensors: ``stand_in`` computes the float64 reference, ``sdpa_cudnn`` SDPA's math
    path in the inputs' dtype (and so is the anchor, FLASH refusing v's own head_dim); every other
    implementation is the real runner (its skips are the real ones)."""
    from flash_attention.fallback.reference import attention_reference

    real = sweep.make_runner

    def make(impl, shape, inputs, mode, config=None):
        if impl == "stand_in" and shape.dv <= shape.head_dim:

            def f(q, k, v):
                return attention_reference(q, k, v, causal=shape.causal, compute_dtype=torch.float64)[0]

        elif impl == "sdpa_cudnn" and shape.dv <= shape.head_dim:

            def f(q, k, v):
                return _math(q, k, v, shape.causal)

        else:
            return real(impl, shape, inputs, mode, config)
        call = (lambda i: f(*inputs[i])) if mode == "fwd" else runners._autograd_call(f, inputs, mode)
        return Runner(call, lambda i: f(*inputs[i]))

    monkeypatch.setattr(sweep, "make_runner", make)
    monkeypatch.setattr(sweep, "make_inputs", lambda shape, n, device: make_inputs(shape, n, "cpu"))
    monkeypatch.setattr(sweep, "time_cuda", lambda fn, n, **kw: SimpleNamespace(ms=MS, ms_min=MS, reps=3))
    monkeypatch.setattr(sweep, "measure_matmul_tflops", lambda **kw: 800.0)
    monkeypatch.setattr(sweep, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(sweep, "_cuda_context_ok", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        sweep,
        "environment",
        lambda device, commit=None, allow_dirty=False: {
            "gpu": "stand-in",
            "driver": "-",
            "cuda": "-",
            "torch": torch.__version__,
            "commit": "test",
            "sm_count": 0,
        },
    )


@pytest.mark.parametrize(("d", "dv"), [(32, 16), (48, 32), (64, 16)])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_sweep_rows_carry_head_dim_v_and_count_its_flops(cpu_sweep, tmp_path, mode, d, dv):
    s = SweepSettings(
        impls=("stand_in", "sdpa_flash", "sdpa_cudnn"),
        seqlens=(32,),
        head_dims=(d, 8),  # 8: under v's head_dim, skipped by every implementation
        causal=(False, True),
        mode=mode,
        tokens=64,
        width=64,
        head_dim_v=dv,
        warmup=0,
        min_reps=1,
        min_time_s=0.0,
    )
    out = tmp_path / "dv.json"
    result, status = run_sweep(s, out, allow_dirty=True)
    assert status == 0 and "aborted" not in result
    assert result["settings"]["head_dim_v"] == dv
    rows = result["rows"]
    assert {(r["impl"], r["causal"]) for r in rows} == {
        (impl, c) for impl in ("stand_in", "sdpa_cudnn") for c in (False, True)
    }
    for r in rows:
        assert (r["head_dim"], r["head_dim_v"], r["heads"], r["batch"]) == (d, dv, 64 // d, 2)
        expected = flops(2, 64 // d, 32, 32, d, r["causal"], mode, head_dim_v=dv)
        assert r["tflops"] == round(expected / (MS * 1e-3) / 1e12, 2) and r["tflops"] > 0
        # The max-diff check against the anchor (SDPA's math path here) on the dv-wide outputs.
        assert r["sdpa_ref"] == "sdpa_cudnn" and r["max_diff_vs_sdpa"] < 0.05 and not r["nonfinite"]
    stand_in = [r for r in rows if r["impl"] == "stand_in"]
    assert all(r["max_diff_vs_sdpa"] > 0 for r in stand_in)  # (float64 against bf16: compared, not copied)
    skipped = {(r["impl"], r["head_dim"], r["causal"]): r for r in result["skipped"]}
    for c in (False, True):
        assert "FlashAttention-2 requires one head_dim" in skipped[("sdpa_flash", d, c)]["reason"]
        for impl in s.impls:
            row = skipped[(impl, 8, c)]
            assert row["head_dim_v"] == dv and f"v's head_dim ({dv}) is wider" in row["reason"]
    assert len(skipped) == 2 + 6
    # The file keeps them; old rows without head_dim_v stay distinct points, and load as they did.
    saved = load_results(out)
    assert [r["head_dim_v"] for r in saved["rows"]] == [dv] * 4
    old = {k: v for k, v in rows[0].items() if k != "head_dim_v"}
    assert row_key(old) != row_key(rows[0])
    assert row_key({**old, "head_dim_v": old["head_dim"]}) == row_key(old)
    both = merged({**saved, "rows": [old]}, saved)
    assert len(both["rows"]) == 5
    json.dumps(both)


def test_sweep_without_head_dim_v_writes_rows_as_before(cpu_sweep, tmp_path):
    s = SweepSettings(
        impls=("stand_in",), seqlens=(32,), head_dims=(16,), causal=(True,), tokens=32, width=32, warmup=0
    )
    result, status = run_sweep(s, None)
    assert status == 0 and "head_dim_v" not in result["settings"]
    (row,) = result["rows"]
    assert "head_dim_v" not in row
    assert row["tflops"] == round(flops(1, 2, 32, 32, 16, True) / (MS * 1e-3) / 1e12, 2)

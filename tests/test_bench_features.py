"""bench --features (tools/bench/features.py): each feature's call on the CPU's PyTorch fallback (the rows'
calls are the same functions the GPU times), with the properties that make its row comparable to the plain
one: equal work where it claims equal work (full key ranges and a packed batch of equal documents give the
plain call's gradients), a window's band counted as its useful work, every leaf's gradient computed (the
sinks' too), and the CLI's wiring."""

from __future__ import annotations

import pytest
import torch

from flash_attention.tools.bench import cli
from flash_attention.tools.bench.features import FEATURES, FeaturesSettings, _feature_call
from flash_attention.tools.common import flops


def _inputs(b=2, n=48, h=4, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=gen) for _ in range(4)]


@pytest.mark.parametrize("causal", [False, True])
def test_every_feature_runs_forward_and_backward_with_its_work(causal):
    s = FeaturesSettings(window=16, gqa_group=2)
    q, k, v, do = _inputs()
    b, n, h, d = q.shape
    plain_work = flops(b, h, n, n, d, causal, "fwd_bwd")
    for feature in FEATURES:
        made = _feature_call(feature, s, causal, q, k, v, do)
        if feature == "window" and not causal:
            assert isinstance(made, str) and "causal" in made
            continue
        call, work = made
        grads = call(0)
        assert len(grads) == (4 if feature == "sinks" else 3), feature
        assert all(torch.isfinite(g).all() for g in grads), feature
        if feature == "window":
            assert work == flops(b, h, n, n, d, True, "fwd_bwd", window=16) < plain_work
        else:
            assert work == plain_work, feature
        if feature == "gqa":
            assert grads[1].shape == (b, n, h // 2, d)
        if feature == "sinks":
            assert grads[3].shape == (h,) and grads[3].abs().sum() > 0


@pytest.mark.parametrize("feature", ["key_range", "varlen"])
def test_equal_work_features_give_the_plain_calls_gradients(feature):
    # Full key ranges and a packed batch of documents as long as the batch's rows are the plain call by
    # another path: the same gradients (the fallback computes both in float32).
    s = FeaturesSettings()
    q, k, v, do = _inputs(seed=1)
    plain = _feature_call("plain", s, True, q, k, v, do)[0](0)
    other = _feature_call(feature, s, True, q, k, v, do)[0](0)
    for a, e in zip(other, plain, strict=True):
        torch.testing.assert_close(a.reshape(e.shape), e, rtol=1e-5, atol=1e-5)


def test_unknown_feature_and_indivisible_groups_are_named():
    q, k, v, do = _inputs(h=3)
    with pytest.raises(ValueError, match="unknown feature 'nope'"):
        _feature_call("nope", FeaturesSettings(), False, q, k, v, do)
    assert "groups of 4" in _feature_call("gqa", FeaturesSettings(), False, q, k, v, do)


def test_the_cli_takes_features_and_needs_a_gpu(capsys):
    args = cli.build_parser().parse_args(["--features", "--head-dims", "64", "--seqlens", "2k"])
    assert args.features and args.head_dims == (64,) and args.seqlens == (2048,)
    if not torch.cuda.is_available():
        assert cli.main(["--features"]) == 2
        assert "CUDA GPU" in capsys.readouterr().err

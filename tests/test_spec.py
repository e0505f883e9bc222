"""The spec's packed form for the torch ops (spec.OpOptions, spec.pack_options): every option survives the
round trip through the schemas' two lists, in the types the launch layer and the fallback read."""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attention.spec import OpOptions, pack_options
from flash_attention.spec.score_functions import values_of


@pytest.mark.parametrize(
    "causal, deterministic, window, softcap, dropout_p",
    list(
        itertools.product(
            (False, True), (False, True), (None, (0, 0), (7, -1), (-1, 3)), (0.0, 30.0), (0.0, 0.1)
        )
    ),
)
def test_options_survive_the_round_trip(causal, deterministic, window, softcap, dropout_p):
    opt = OpOptions(causal, 0.0883883, deterministic, dropout_p, window, values_of(softcap=softcap))
    ints, floats = opt.pack()
    assert all(type(x) is int for x in ints) and all(type(x) is float for x in floats)
    packed = pack_options(causal, 0.0883883, deterministic, dropout_p, window, softcap=softcap)
    assert (ints, floats) == packed
    assert opt.score_values == ({"softcap": softcap} if softcap else {})
    back = OpOptions.unpack(ints, floats)
    assert back == opt and type(back.causal) is bool and type(back.deterministic) is bool
    assert back.window is None or type(back.window) is tuple
    # (as a schema hands them back: int[] and float[] may come as other sequences)
    assert OpOptions.unpack(tuple(ints), torch.tensor(floats, dtype=torch.float64).tolist()) == opt


def test_a_window_of_zeros_is_not_no_window():
    # (0, 0) sees only the diagonal; None sees everything: the packed form keeps them apart.
    assert OpOptions.unpack(*pack_options(False, 1.0, window=(0, 0))).window == (0, 0)
    assert OpOptions.unpack(*pack_options(False, 1.0)).window is None


@pytest.mark.parametrize(
    ("ranged", "alibi", "sinks", "segments"), [(False, False, False, 0), (True, True, True, 3)]
)
def test_op_options_make_the_spec_the_fallback_takes(ranged, alibi, sinks, segments):
    # The torch ops' PyTorch path takes an AttentionSpec built from the packed options and what the call's
    # tensors say; every option survives, and the score function's build follows the cap and ALiBi.
    from flash_attention.spec import AttentionSpec, ScoreSpec

    opt = OpOptions(True, 0.3, True, 0.25, (7, -1), (("softcap", 12.5),))
    spec = OpOptions.unpack(*opt.pack()).attention_spec(
        ranged=ranged, alibi=alibi, sinks=sinks, segments=segments
    )
    assert spec == AttentionSpec(
        True, 0.3, (7, -1), ScoreSpec.of(softcap=12.5, alibi=alibi), ranged, 0.25, True, sinks, segments
    )
    assert spec.score.build == ("softcap_alibi" if alibi else "softcap")


def test_kv_cache_problem_spec_carries_its_options():
    from flash_attention.spec import ScoreSpec
    from flash_attention.spec.validate_kvcache import CacheProblem

    problem = CacheProblem(2, 1, 8, 2, 128, 0, 0, 4096, 0.125, True, (255, -1), 1, (("softcap", 30.0),))
    spec = problem.attention_spec
    assert (spec.causal, spec.scale, spec.window, spec.score) == (
        True,
        0.125,
        (255, -1),
        ScoreSpec.of(softcap=30.0, alibi=True),
    )
    assert not (spec.ranged or spec.dropout_p or spec.deterministic or spec.sinks or spec.segments)


def test_kernel_build_is_derived_from_the_spec_alone():
    # ops.plans.kernel_build: the one function from a call's spec (at its lengths) to its kernel build.
    from flash_attention.jit.sources import SEGMENTS
    from flash_attention.ops.plans import KernelBuild, kernel_build
    from flash_attention.spec import AttentionSpec, ScoreSpec

    plain = AttentionSpec(False, 0.1)
    assert kernel_build(plain, 100, 100) == KernelBuild(False, False, False, False, None)
    # Causal keeps its entry point; a window that bounds something takes the window build, whose one entry
    # point is named as not causal (the bounds carry causal), and one that bounds nothing the causal build.
    assert kernel_build(AttentionSpec(True, 0.1), 100, 100).causal
    windowed = AttentionSpec(True, 0.1, window=(16, 0))
    assert kernel_build(windowed, 100, 100) == KernelBuild(False, False, False, True, None)
    assert kernel_build(windowed, 8, 8) == KernelBuild(True, False, False, False, None)  # (16 >= 8 + 8)
    packed = AttentionSpec(True, 0.1, score=ScoreSpec.of(softcap=5.0), ranged=True, dropout_p=0.1, segments=2)
    assert kernel_build(packed, 100, 100) == KernelBuild(False, True, True, SEGMENTS, "softcap")
    assert kernel_build(packed, 100, 100).variant == dict(
        ranged=True, dropout=True, window=SEGMENTS, score="softcap"
    )


def test_every_score_build_names_a_policy_the_kernels_declare():
    # spec.score_builds derives each build's name and C++ policy from a ScoreSpec's features; every policy
    # must be a type csrc/include/fa/variant.cuh declares (a rename on one side fails here, not at a JIT).
    import re
    from pathlib import Path

    from flash_attention.jit.sources import SCORE_MODS
    from flash_attention.spec import ScoreSpec

    header = (Path(__file__).resolve().parents[1] / "flash_attention/csrc/include/fa/variant.cuh").read_text()
    declared = set(re.findall(r"^(?:using|struct) (\w+)", header, flags=re.M))
    assert len(SCORE_MODS) == 13
    for build, policy in SCORE_MODS.items():
        assert policy.startswith("fa::") and policy[4:] in declared, (build, policy)
    spec = ScoreSpec.of(softcap=30.0, alibi=True, alibi_origin="runs", alibi_rows=True)
    assert (spec.build, spec.policy) == ("softcap_alibi_runs_rows", "fa::SoftcapAlibiRunsRows")
    assert (ScoreSpec().build, ScoreSpec().policy) == (None, None)


def test_score_values_are_checked_by_name():
    # The layers below the public functions take the scalar score functions by name: an unknown name is a
    # TypeError naming it (a misspelt keyword), never a silently plain call.
    with pytest.raises(TypeError, match="softcapp"):
        pack_options(False, 1.0, softcapp=30.0)
    from flash_attention.spec.validate import check_score

    with pytest.raises(TypeError, match="softcapp"):
        check_score(None, torch.randn(1, 2, 1, 8), softcapp=30.0)
    with pytest.raises(ValueError, match="softcap"):
        check_score(None, torch.randn(1, 2, 1, 8), softcap=-1.0)

"""The spec's packed form for the torch ops (spec.OpOptions, spec.pack_options): every option survives the
round trip through the schemas' two lists, in the types the launch layer and the fallback read."""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attention.spec import OpOptions, pack_options


@pytest.mark.parametrize(
    "causal, deterministic, window, softcap, dropout_p",
    list(
        itertools.product(
            (False, True), (False, True), (None, (0, 0), (7, -1), (-1, 3)), (0.0, 30.0), (0.0, 0.1)
        )
    ),
)
def test_options_survive_the_round_trip(causal, deterministic, window, softcap, dropout_p):
    opt = OpOptions(causal, 0.0883883, deterministic, dropout_p, window, softcap)
    ints, floats = opt.pack()
    assert all(type(x) is int for x in ints) and all(type(x) is float for x in floats)
    assert (ints, floats) == pack_options(causal, 0.0883883, deterministic, dropout_p, window, softcap)
    back = OpOptions.unpack(ints, floats)
    assert back == opt and type(back.causal) is bool and type(back.deterministic) is bool
    assert back.window is None or type(back.window) is tuple
    # (as a schema hands them back: int[] and float[] may come as other sequences)
    assert OpOptions.unpack(tuple(ints), torch.tensor(floats, dtype=torch.float64).tolist()) == opt


def test_a_window_of_zeros_is_not_no_window():
    # (0, 0) sees only the diagonal; None sees everything: the packed form keeps them apart.
    assert OpOptions.unpack(*pack_options(False, 1.0, window=(0, 0))).window == (0, 0)
    assert OpOptions.unpack(*pack_options(False, 1.0)).window is None

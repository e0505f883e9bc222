"""tools/profile_call.py on the CPU: its shape argument is checked with a message naming it, and without a GPU
it says so and exits 2 instead of failing inside a CUDA call."""

from __future__ import annotations

import pytest
import torch
from repo_tools import load_tool

profile_call = load_tool("profile_call")


def test_shape_is_batch_seqlen_heads():
    assert profile_call.parse_shape("4,4096,16") == (4, 4096, 16)
    for bad in ("4,4096", "4,0,16", "a,b,c", "4,4096,16,2"):
        with pytest.raises(ValueError, match="--shape"):
            profile_call.parse_shape(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_a_gpu_it_says_so(capsys):
    assert profile_call.main(["flash_attention", "--shape", "1,128,2", "--head-dim", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

"""attention_varlen's checks of its offsets' values (flash_attention.spec.validate_varlen), on the CPU: every
broken promise (offsets not from 0, decreasing, past the tensors; seqused_k negative or past its sequence's
keys) raises ValueError naming the argument and its first bad index; valid offsets, zero-length sequences
included, still agree with each sequence run alone in float64; and a GPU's path (reads not free, taken here
by CPU tensors) checks them only with FLASH_ATTENTION_CHECK_OFFSETS=1, through the same function."""

from __future__ import annotations

import re

import pytest
import torch
from test_varlen import _offsets

import flash_attention
from flash_attention.api import varlen
from flash_attention.fallback.reference import attention_reference
from flash_attention.spec import validate_varlen as _validate_varlen

# (cu_seqlens_q, cu_seqlens_k, seqused_k, the error) for q of 10 rows and k, v of 12 keys
BAD = [
    (
        [0, 6, 4, 10],
        [0, 4, 8, 12],
        None,
        "cu_seqlens_q must be non-decreasing; cu_seqlens_q[2] = 4 < cu_seqlens_q[1] = 6",
    ),
    (  # several breaks: the first is named
        [0, 3, 2, 1, 10],
        [0, 3, 6, 9, 12],
        None,
        "cu_seqlens_q must be non-decreasing; cu_seqlens_q[2] = 2 < cu_seqlens_q[1] = 3",
    ),
    ([2, 6, 10], [0, 6, 12], None, "cu_seqlens_q must start at 0; got cu_seqlens_q[0] = 2"),
    ([-1, 6, 10], [0, 6, 12], None, "cu_seqlens_q must start at 0; got cu_seqlens_q[0] = -1"),
    ([0, 6, 11], [0, 6, 12], None, "cu_seqlens_q[2] = 11 is past the end of q (q.shape[0] = 10 rows)"),
    ([0, 16, 16], [0, 6, 12], None, "cu_seqlens_q[1] = 16 is past the end of q (q.shape[0] = 10 rows)"),
    (
        [0, 4, 8, 10],
        [0, 3, 9, 7],
        None,
        "cu_seqlens_k must be non-decreasing; cu_seqlens_k[3] = 7 < cu_seqlens_k[2] = 9",
    ),
    ([0, 5, 10], [1, 5, 12], None, "cu_seqlens_k must start at 0; got cu_seqlens_k[0] = 1"),
    ([0, 5, 10], [0, 13, 13], None, "cu_seqlens_k[1] = 13 is past the end of k (k.shape[0] = 12 keys)"),
    ([0, 3, 1], [0, 9, 4], None, "cu_seqlens_q must be non-decreasing"),  # both broken: q's is named
    (
        [0, 5, 10],
        [0, 6, 12],
        [7, 6],
        "seqused_k[0] = 7 exceeds sequence 0's 6 keys (cu_seqlens_k[1] - cu_seqlens_k[0])",
    ),
    (
        [0, 2, 5, 10],
        [0, 6, 6, 12],
        [6, 0, 9],
        "seqused_k[2] = 9 exceeds sequence 2's 6 keys (cu_seqlens_k[3] - cu_seqlens_k[2])",
    ),
    ([0, 5, 10], [0, 6, 12], [6, -1], "seqused_k[1] = -1 must be >= 0"),
]


def _tensors(seed: int, total_q: int = 10, total_k: int = 12):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, 4, 16, generator=gen)
    k, v = (torch.randn(total_k, 2, 16, generator=gen) for _ in range(2))
    return q, k, v


def _call(q, k, v, cu_q, cu_k, used, dtype=torch.int32, **kw):
    cu_q, cu_k = (torch.tensor(c, dtype=dtype) for c in (cu_q, cu_k))
    seqused_k = None if used is None else torch.tensor(used, dtype=dtype)
    return flash_attention.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused_k, **kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", BAD, ids=lambda c: c[3][:48])
def test_bad_offsets_are_refused_naming_the_argument_and_index(case, dtype):
    cu_q, cu_k, used, error = case
    q, k, v = _tensors(len(cu_q) * 31 + len(cu_k))
    with pytest.raises(ValueError, match=re.escape(error)):
        _call(q, k, v, cu_q, cu_k, used, dtype)
    with pytest.raises(ValueError, match=re.escape(error)):  # a call autograd records too
        _call(q.requires_grad_(), k, v, cu_q, cu_k, used, dtype, causal=True)


def test_offsets_refilled_in_place_with_bad_values_are_refused():
    # The check runs where the runs are built, which a cached call skips: refilling the offsets in place
    # bumps their version, so the next call builds (and checks) again.
    q, k, v = _tensors(3)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    cu_k[1] = 3
    cu_k[2] = 2
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k[2] = 2 < cu_seqlens_k[1] = 3")):
        flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=True)


def _random_batch(seed: int):
    """Lengths of a random batch (1 to 5 sequences, at least one of 0 queries and one of 0 keys), keys in use
    (or None) and rows and keys past the last sequence."""
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 6, (1,), generator=gen))
    lens_q = torch.randint(0, 13, (batch,), generator=gen)
    lens_k = torch.randint(0, 15, (batch,), generator=gen)
    lens_q[int(torch.randint(0, batch, (1,), generator=gen))] = 0
    lens_k[int(torch.randint(0, batch, (1,), generator=gen))] = 0
    used = None
    if seed % 2:  # each in [0, its keys], both ends included
        used = (torch.rand(batch, generator=gen) * (lens_k + 1)).floor().long().minimum(lens_k).tolist()
    spare_q, spare_k = (int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(2))
    return lens_q.tolist(), lens_k.tolist(), used, spare_q, spare_k


@pytest.mark.parametrize("seed", range(8))
def test_valid_offsets_pass_and_match_each_sequence_alone(seed):
    lens_q, lens_k, used, spare_q, spare_k = _random_batch(seed)
    causal = seed % 4 < 2
    dtype = torch.int64 if seed % 3 == 0 else torch.int32
    q, k, v = _tensors(100 + seed, sum(lens_q) + spare_q, sum(lens_k) + spare_k)
    cu_q, cu_k = _offsets(lens_q).to(dtype), _offsets(lens_k).to(dtype)
    seqused_k = None if used is None else torch.tensor(used, dtype=dtype)
    out, lse = flash_attention.attention_varlen(
        q, k, v, cu_q, cu_k, seqused_k=seqused_k, causal=causal, return_lse=True
    )
    used = used or lens_k
    q0 = k0 = 0
    for m, n_all, n in zip(lens_q, lens_k, used, strict=True):
        qs, ks = slice(q0, q0 + m), slice(k0, k0 + n)
        q0, k0 = q0 + m, k0 + n_all
        if m == 0:
            continue
        ref, ref_lse = attention_reference(
            *(t[s].double().unsqueeze(0) for t, s in ((q, qs), (k, ks), (v, ks))), causal=causal
        )
        torch.testing.assert_close(out[qs].double(), ref[0], atol=2e-6, rtol=2e-6)
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(finite, torch.isfinite(lse[:, qs]))
        torch.testing.assert_close(lse[:, qs].double()[finite], ref_lse[0][finite], atol=2e-6, rtol=2e-6)
    assert not out[sum(lens_q) :].any()  # rows past the last sequence


def test_a_batch_of_no_sequence_passes_with_its_empty_seqused_k():
    q, k, v = _tensors(4, 3, 2)
    out = _call(q, k, v, [0], [0], [])
    assert not out.any()


@pytest.fixture
def gpu_path(monkeypatch):
    """CPU tensors on a GPU's path (reading them is not free), and a record of the offsets checks."""
    monkeypatch.setattr(_validate_varlen, "reads_are_free", lambda device: False)
    monkeypatch.delenv(_validate_varlen.ENV, raising=False)
    calls = []

    def spy(*args):
        calls.append(args)
        return _validate_varlen.check_offset_values(*args)

    monkeypatch.setattr(varlen, "check_offset_values", spy)
    return calls


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[3][:48])
def test_a_gpus_path_checks_the_offsets_only_when_asked(case, gpu_path, monkeypatch):
    cu_q, cu_k, used, error = case
    q, k, v = _tensors(7)
    for off in (None, "0"):  # not asked: nothing read, the call goes on (its rows wrong, never out of bounds)
        if off is not None:
            monkeypatch.setenv(_validate_varlen.ENV, off)
        out = _call(q, k, v, cu_q, cu_k, used)
        assert out.shape == q.shape and not gpu_path
    monkeypatch.setenv(_validate_varlen.ENV, "1")
    with pytest.raises(ValueError, match=re.escape(error)):
        _call(q, k, v, cu_q, cu_k, used)
    assert len(gpu_path) == 1


def test_a_gpus_path_checks_valid_offsets_once_per_tensor(gpu_path, monkeypatch):
    monkeypatch.setenv(_validate_varlen.ENV, "1")
    q, k, v = _tensors(8)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 0, 12], dtype=torch.int32)
    first = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    again = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=True)  # the cached runs: no check
    assert len(gpu_path) == 1 and torch.equal(first, again)
    monkeypatch.delenv(_validate_varlen.ENV)
    unchecked = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert len(gpu_path) == 1 and torch.equal(first, unchecked)


def test_when_the_offsets_are_checked(monkeypatch):
    cuda, cpu, meta = (torch.device(d) for d in ("cuda", "cpu", "meta"))
    monkeypatch.delenv(_validate_varlen.ENV, raising=False)
    assert _validate_varlen.checks_offset_values(cpu, False)
    assert not _validate_varlen.checks_offset_values(cuda, False)
    monkeypatch.setenv(_validate_varlen.ENV, "1")
    assert _validate_varlen.checks_offset_values(cuda, False)
    assert not _validate_varlen.checks_offset_values(cuda, True)  # a CUDA graph being captured
    assert not _validate_varlen.checks_offset_values(meta, False)  # (no values to read)

"""flash_attention.precompile and the transformers integration's precompile_model, without a GPU: which
kernels they name for which calls (against the selection functions the calls use, asked directly), that
they compile them into the disk cache in parallel and find them there the second time, and that bad
arguments are refused by name. tests/test_gpu_precompile.py checks on a GPU that the calls then compile
nothing."""

from __future__ import annotations

import types

import pytest
import torch

import flash_attention as fa
from flash_attention.api.precompile import jobs_for_calls
from flash_attention.configs import parse_bwd_config, parse_config
from flash_attention.configs.decode import default_decode_config, parse_decode_config
from flash_attention.integrations.transformers import precompile_model
from flash_attention.jit import cache as jit_cache
from flash_attention.jit.compiler import choose_compiler, compiler_id
from flash_attention.ops.precompile import DeviceFacts
from flash_attention.ops.select import backward_config, forward_config
from flash_attention.ops.winners import SEQLEN_BUCKETS


def _parse(name: str):
    config = name.split(" [")[0]
    if config.startswith("bwd_"):
        return parse_bwd_config(config)
    if config.startswith("decode_"):
        return parse_decode_config(config)
    return parse_config(config)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_calls_name_the_forward_and_backward_each_length_chooses(arch, dtype):
    # What the calls would choose, asked of the selection functions one call at a time (the plans'
    # functions, with the facts an architecture gives without its GPU).
    facts = DeviceFacts.of_arch(arch)
    device = dict(arch=arch, gpu="", smem_limit=facts.smem_limit)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    expected = set()
    for causal in (False, True):
        for n in SEQLEN_BUCKETS:
            expected.add(forward_config(name, 128, causal, n, n, 4, **device).name())
            expected.add(backward_config(name, 128, causal, n, n, 4, **device).name())
    names = fa.precompile(128, dtype=dtype, heads_q=32, heads_kv=8, training=True, device=arch, dry_run=True)
    assert set(names) == expected
    assert len(names) == len(set(names))  # each translation unit once
    for n in names:
        assert _parse(n).dtype == name


def test_variants_name_their_builds():
    kw = dict(heads_q=16, heads_kv=16, causal=True, device="sm_90", dry_run=True, seqlens=[2048])
    assert all(
        n.endswith("[window+softcap]") for n in fa.precompile(128, window=(511, 0), softcap=30.0, **kw)
    )
    # A window is taken in every form attention() takes (a list too: a config read from JSON has lists).
    assert fa.precompile(128, window=[511, 0], **kw) == fa.precompile(128, window=(511, 0), **kw)
    assert all(n.endswith("[alibi]") for n in fa.precompile(64, alibi=True, **kw))
    assert all(n.endswith("[softcap_alibi]") for n in fa.precompile(64, alibi=True, softcap=5.0, **kw))
    assert all(
        n.endswith("[key_range+dropout]") for n in fa.precompile(64, key_range=True, dropout_p=0.1, **kw)
    )
    plain = fa.precompile(64, **kw)
    assert plain and all("[" not in n for n in plain)
    # Packed batches: the segments build; ALiBi there measures from the sequences' runs or a table.
    packed = fa.precompile(64, varlen=True, alibi=True, training=True, **kw)
    assert {n.split(" [")[1] for n in packed} == {
        f"segments+alibi_{form}]" for form in ("runs", "table", "runs_rows", "table_rows")
    }
    assert any(n.startswith("bwd_") for n in packed)
    assert {n.split(" [")[1] for n in packed} == {
        n.split(" [")[1]
        for n in fa.precompile(64, varlen=True, window=(8, 0), alibi=True, training=True, **kw)
    }  # (a packed batch's window is carried by its runs: the same builds)
    with pytest.raises(ValueError, match="key_range"):
        fa.precompile(64, varlen=True, key_range=True, **kw)
    # A window that covers every key at a length runs the plain build there, as the calls do.
    short = dict(kw, seqlens=[128, 4096])
    assert [n.endswith("[window]") for n in fa.precompile(64, window=(511, 0), **short)] == [False, True]


def test_decode_names_the_kernels_of_one_and_a_few_queries():
    names = fa.precompile(
        128, heads_q=32, heads_kv=8, causal=True, decode=True, decode_queries=(1, 4), seqlens=[1024],
        device="sm_90", dry_run=True,
    )  # fmt: skip
    decode = {n for n in names if n.startswith("decode_")}
    facts = DeviceFacts.of_arch("sm_90")
    want = {default_decode_config("bf16", 128, rows, "sm_90").name() for rows in (4, 16)}
    assert decode == want
    # attention() with those few queries against the cache's length: its forward, beside the prefill's.
    few = forward_config("bf16", 128, True, 4, 1024, 4, arch="sm_90", gpu="", smem_limit=facts.smem_limit)
    assert few.name() in names


def test_head_dims_run_on_the_compiled_head_dim_the_calls_pad_to():
    kw = dict(causal=False, seqlens=[512], device="sm_80", dry_run=True)
    assert fa.precompile(36, **kw) == fa.precompile(64, **kw)
    assert fa.precompile([72, 80], **kw) == fa.precompile(128, **kw)
    assert {_parse(n).head_dim for n in fa.precompile([36, 200], **kw)} == {64, 256}


def test_vs_own_head_dim_names_the_kernels_reading_it():
    # DeepSeek's 192 / 128: the forward reading v's head_dim (dv_128) and, in training, the backward kernel
    # reading it (ops.select.value_dim_backward_config), as the calls choose them (the same names the launch
    # layer's choice gives); dropout's and the deterministic mode's backward is q's head_dim's (the calls pad
    # v); no decode kernel takes v's own head_dim.
    from flash_attention.configs import hopper_bwd_config
    from flash_attention.ops.precompile import DeviceFacts

    kw = dict(heads_q=16, causal=True, device="sm_90", dry_run=True, seqlens=[1024, 8192])
    names = fa.precompile(192, head_dim_v=128, training=True, **kw)
    facts = DeviceFacts.of_arch("sm_90")
    for n in (1024, 8192):
        fwd = forward_config(
            "bf16", 192, True, n, n, 1, arch="sm_90", gpu="", smem_limit=facts.smem_limit, head_dim_v=128
        )
        assert fwd.value_dim == 128 and fwd.name() in names
    assert hopper_bwd_config("bf16", 192, causal=True).replace(head_dim_v=128).name() in names
    assert all(_parse(n.split(" [")[0]).value_dim == 128 for n in names if not n.startswith("bwd_"))
    equal = fa.precompile(192, training=True, **kw)
    assert not set(names) & set(equal)  # (every kernel of the equal-dims calls is another)
    det = fa.precompile(192, head_dim_v=128, training=True, deterministic=True, **kw)
    det_equal = fa.precompile(192, training=True, deterministic=True, **kw)
    assert [n for n in det if n.startswith("bwd_")] == [n for n in det_equal if n.startswith("bwd_")]
    decode = fa.precompile(192, head_dim_v=128, decode=True, **kw)
    assert not any(n.startswith("decode_") for n in decode)
    # 128 / 64: the warp-specialized forward reads v's width; the backward is q's head_dim's (v padded).
    narrow = fa.precompile(128, head_dim_v=64, training=True, **kw)
    plain = fa.precompile(128, training=True, **kw)
    assert [n for n in narrow if n.startswith("bwd_")] == [n for n in plain if n.startswith("bwd_")]
    assert all(_parse(n).value_dim == 64 for n in narrow if not n.startswith("bwd_"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(head_dim=128, head_dim_v=256), "head_dim_v"),
        (dict(head_dim=128, head_dim_v=0), "head_dim_v"),
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=[]), "head_dim"),
        (dict(head_dim="128"), "head_dim"),
        (dict(head_dim=128, dtype=torch.float32), "dtype"),
        (dict(head_dim=128, heads_q=6, heads_kv=4), "heads_q"),
        (dict(head_dim=128, heads_kv=0), "heads_kv"),
        (dict(head_dim=128, causal=1), "causal"),
        (dict(head_dim=128, window=4096), "window"),
        (dict(head_dim=128, softcap=-1.0), "softcap"),
        (dict(head_dim=128, softcap=float("inf")), "softcap"),
        (dict(head_dim=128, dropout_p=1.0), "dropout_p"),
        (dict(head_dim=128, seqlens=[0]), "seqlens"),
        (dict(head_dim=128, decode=True, decode_queries=[-1]), "decode_queries"),
        (dict(head_dim=128, device="cpu"), "device"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    kwargs.setdefault("device", "sm_90")
    with pytest.raises((ValueError, TypeError), match=match):
        fa.precompile(**kwargs, dry_run=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_asks_for_the_architecture():
    with pytest.raises(ValueError, match="sm_90"):
        fa.precompile(128, dry_run=True)


@pytest.mark.skipif(choose_compiler() is None, reason="needs NVRTC or nvcc")
def test_it_compiles_into_the_cache_in_parallel_and_reads_it_the_second_time(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    kw = dict(heads_q=4, heads_kv=2, causal=True, seqlens=[512], device="sm_80", workers=2)
    jobs = jobs_for_calls(64, **{k: v for k, v in kw.items() if k != "workers"})
    assert len(jobs) == 1  # one forward kernel: small enough for a CPU test
    names = fa.precompile(64, **kw)
    assert names == [job.describe() for job in jobs]
    cid = compiler_id(choose_compiler())
    for job in jobs:
        key = jit_cache.cache_key(job.cfg, job.arch, cid, False, **job.variant())
        assert (tmp_path / f"{key}.cubin").stat().st_size > 0
        assert (tmp_path / f"{key}.json").exists()
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    calls = []
    monkeypatch.setattr(jit_cache, "_compile_into_cache", lambda *a, **k: calls.append(a))
    assert fa.precompile(64, **kw) == names
    assert calls == []  # read from the cache, not rebuilt
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps


def _config(**kw):
    base = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=2048, dtype=torch.bfloat16)
    return types.SimpleNamespace(**(base | kw))


def test_a_latent_attention_config_gives_its_qk_and_v_head_dims():
    # DeepSeek-V3's multi-head latent attention: q and k of qk_nope_head_dim + qk_rope_head_dim (192), v of
    # v_head_dim (128); its config's head_dim is the rotary part's (64), which no call runs.
    deepseek = _config(head_dim=64, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    names = precompile_model(
        deepseek, training=True, device="sm_90", dry_run=True, seqlens=[4096], padded=False
    )
    assert names == fa.precompile(
        192, head_dim_v=128, heads_q=8, heads_kv=4, causal=True, training=True, device="sm_90", dry_run=True,
        seqlens=[4096],
    )  # fmt: skip
    assert any(n.endswith("_v128") for n in names)


def test_a_model_config_gives_its_layers_kernels():
    # Gemma 2: alternating sliding and full layers, soft-capped, head_dim 256.
    gemma2 = _config(
        head_dim=256, sliding_window=4096, layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=50.0,
    )  # fmt: skip
    names = precompile_model(gemma2, device="sm_90", dry_run=True, seqlens=[4096])
    variants = {n.split(" [")[1].rstrip("]") for n in names if " [" in n}
    assert variants == {"window+softcap", "key_range+window+softcap", "softcap", "key_range+softcap"}
    assert any(n.startswith("decode_bf16_d256") for n in names)  # generate(), not training
    assert not any(n.startswith("bwd_") for n in names)
    training = precompile_model(gemma2, training=True, device="sm_90", dry_run=True, seqlens=[4096])
    assert any(n.startswith("bwd_") for n in training)
    assert not any(n.startswith("decode_") for n in training)
    # Mistral: every layer in the window (no layer_types); Qwen2: a window set but switched off.
    mistral = precompile_model(
        _config(sliding_window=4096), device="sm_90", dry_run=True, seqlens=[512, 8192], padded=False
    )
    forward = [n for n in mistral if not n.startswith("decode_")]
    assert any("window" in n for n in forward)  # 8k prompts: the window build
    assert any("[" not in n for n in forward)  # 512-token prompts: inside the window, the plain build
    qwen = _config(sliding_window=4096, use_sliding_window=False, layer_types=["full_attention"] * 4)
    assert not any("window" in n for n in precompile_model(qwen, device="sm_90", dry_run=True, seqlens=[512]))
    # head_dim from the width where the config has none; a float32 model compiles nothing of ours.
    plain = precompile_model(_config(), device="sm_90", dry_run=True, seqlens=[512], padded=False)
    assert {_parse(n).head_dim for n in plain} == {256} and all("[" not in n for n in plain)
    with pytest.raises(ValueError, match="dtype"):
        precompile_model(_config(dtype=torch.float32), device="sm_90", dry_run=True)
    with pytest.raises(ValueError, match="num_attention_heads"):
        precompile_model(types.SimpleNamespace(hidden_size=64), device="sm_90", dry_run=True)


def test_a_module_is_read_for_its_dtype_and_mode():
    module = torch.nn.Linear(4, 4).to(torch.float16)
    module.config = _config(head_dim=64, dtype=torch.bfloat16)
    module.train()
    names = precompile_model(module, device="sm_90", dry_run=True, seqlens=[512], padded=False)
    assert any(n.startswith("bwd_fp16") for n in names)  # the parameters' dtype, and training
    module.eval()
    names = precompile_model(module, device="sm_90", dry_run=True, seqlens=[512], padded=False)
    assert not any(n.startswith("bwd_") for n in names) and any(n.startswith("decode_fp16") for n in names)

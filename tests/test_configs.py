"""KernelConfig: names that parse back, validity rules that agree with the kernel's static_asserts."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import shutil
import subprocess

import pytest

from flash_attention.configs import (
    HEAD_DIMS,
    KernelConfig,
    default_config,
    padded_head_dim,
    parse_config,
    validity_errors,
    wgmma_config,
    ws_config,
)
from flash_attention.configs.forward import block_registers, register_split
from flash_attention.jit.compiler import CSRC
from flash_attention.jit.sources import kernel_source


def _space(n_random: int = 2500, seed: int = 0) -> list[KernelConfig]:
    """Candidate configs, valid and invalid: a structured grid plus random draws off the edges."""
    rng = random.Random(seed)
    out = []
    for dtype, d, bq, bkv, w in itertools.product(
        ("fp16", "bf16"), HEAD_DIMS, (16, 32, 64, 128, 256), (16, 32, 64, 128, 256), (1, 2, 4, 8)
    ):
        out.append(KernelConfig.unchecked(dtype, d, bq, bkv, w, q_frags=0, k_frags=1, v_frags=1))
    for _ in range(n_random):
        out.append(
            KernelConfig.unchecked(
                rng.choice(["fp16", "bf16"]),
                rng.choice([32, 64, 96, 128, 192, 256, 320]),
                rng.choice([16, 32, 48, 64, 96, 128, 256, 512]),
                rng.choice([8, 16, 32, 48, 64, 128, 256]),
                rng.choice([1, 2, 3, 4, 8, 16]),
                async_copy=rng.random() < 0.7,
                eager=rng.random() < 0.6,
                swizzle=rng.random() < 0.7,
                q_frags=rng.choice([0, 1, 2, 3, 4, 8]),
                k_frags=rng.choice([0, 1, 2, 3, 4, 8]),
                v_frags=rng.choice([0, 1, 2, 3, 4]),
                double_buffer=rng.random() < 0.5,
                opt_softmax=rng.random() < 0.5,
                reverse_kv=rng.random() < 0.3,
                wgmma=rng.random() < 0.1,
                stages=rng.choice([1, 1, 1, 2, 5]),
            )
        )
    # The wgmma family: its fixed flags, tile shapes and ring depths, on and off the valid edges.
    for dtype, d, bq, bkv, w, stages in itertools.product(
        ("fp16", "bf16"), HEAD_DIMS, (64, 128, 192), (32, 64, 128, 256), (4, 8, 12), (0, 1, 2, 3, 4, 5)
    ):
        out.append(
            KernelConfig.unchecked(
                dtype, d, bq, bkv, w, wgmma=True, stages=stages, k_frags=0, v_frags=0, double_buffer=False
            )
        )
    # The warp-specialized family: producer + consumer warp counts on and off the rule, rings 1 to 4 deep.
    for dtype, d, bq, bkv, w, stages, wgmma in itertools.product(
        ("bf16",), HEAD_DIMS, (64, 128, 192), (64, 128), (8, 12, 16), (1, 2, 3, 4), (True, False)
    ):
        out.append(
            KernelConfig.unchecked(
                dtype,
                d,
                bq,
                bkv,
                w,
                wgmma=wgmma,
                stages=stages,
                warp_specialized=True,
                k_frags=0,
                v_frags=0,
                double_buffer=False,
            )  # fmt: skip
        )
    # Persistent ones stage their output in a tile of their own: shared memory on and off the limit.
    for d, bkv, stages in itertools.product(HEAD_DIMS, (64, 80, 128, 176), (2, 3)):
        out.append(ws_config("bf16", d, 128, bkv, stages, overlap=True, persistent=True, check=False))
    # tma_store and tile_overlap: with and without the warp-specialized kernel they need, on every schedule.
    flags = (True, False)
    for d, ws, persistent, pingpong, tile in itertools.product((64, 128), flags, flags, flags, flags):
        knobs = dict(pingpong=pingpong, persistent=persistent, tma_store=True, tile_overlap=tile)
        cfg = ws_config("bf16", d, 128, 128, 2, overlap=True, **knobs, check=False)
        if not ws:  # the same knobs on the plain wgmma kernel (8 warps, no producer)
            fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
            cfg = KernelConfig.unchecked(
                **{**fields, "num_warps": 8, "warp_specialized": False, "overlap": False}
            )
        out.append(cfg)
    # exp_poly: in range and out, on the warp-specialized kernel and off it.
    for d, ep, ws in itertools.product((64, 128), (0, 4, 8, 9), (True, False)):
        cfg = ws_config("bf16", d, 128, 128, 2, overlap=True, exp_poly=ep, check=False)
        if not ws:
            fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
            cfg = KernelConfig.unchecked(
                **{**fields, "num_warps": 8, "warp_specialized": False, "overlap": False}
            )
        out.append(cfg)
    # e4m3 (FP8): block_kv on and off the 128-key rule, every head_dim, v's own head_dim, persistent or not
    # (shared memory on and off the limit), and off the warp-specialized kernel.
    for d, bkv, stages, persistent, dv in itertools.product(
        HEAD_DIMS, (48, 64, 96, 128, 176, 192, 256), (2, 3, 4), flags, (0, 64)
    ):
        if dv == d:
            continue  # (v's head_dim equal to q's is the unset form to the kernel: C++ cannot tell them so)
        cfg = ws_config("e4m3", d, 128, bkv, stages, overlap=True, persistent=persistent, check=False)
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        out.append(KernelConfig.unchecked(**{**fields, "head_dim_v": dv}))
    for d in (128, 256):
        cfg = ws_config("e4m3", d, 128, 128, 2, check=False)
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        out.append(KernelConfig.unchecked(**{**fields, "num_warps": 8, "warp_specialized": False}))
    return out


def _valid(space):
    return [c for c in space if not validity_errors(c)]


def test_space_has_both_valid_and_invalid():
    space = _space()
    n_valid = len(_valid(space))
    assert 300 < n_valid < len(space) - 300


@pytest.mark.parametrize(
    "cfg", _valid(_space(3000, seed=1))[:300] + [c for c in _valid(_space(0)) if c.wgmma][::7], ids=str
)
def test_name_and_symbol_round_trip(cfg):
    assert parse_config(cfg.name()) == cfg
    assert parse_config(str(cfg)) == cfg
    for causal in (False, True):
        sym = cfg.symbol(causal)
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", sym), sym
        assert parse_config(sym) == cfg


def test_name_format_of_the_ancestor():
    cfg = KernelConfig("bf16", 128, 64, 64, 4, q_frags=0, k_frags=2, v_frags=2)
    assert cfg.name() == "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax"
    plain = parse_config("(FP16, 64, 64, 64, 4): sync+load_0_0_0_tiles")
    assert (plain.async_copy, plain.eager, plain.swizzle, plain.double_buffer, plain.opt_softmax) == (
        False,
        False,
        False,
        False,
        False,
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ("(BF16, 128, 64, 64, 4): async+warp_specialized", "unknown flag 'warp_specialized'"),
        ("(BF16, 128, 64, 64, 4): eager+swizzled", "must say 'async' or 'sync'"),
        ("(BF16, 128, 48, 64, 4): async", "block_q must be a multiple of 16 \\* num_warps"),
        ("(BF16, 100, 64, 64, 4): async", "head_dim must be one of"),
        ("(BF16, 128, 64, 64, 4): sync+eager", "eager loading needs async_copy"),
        ("(FP32, 128, 64, 64, 4): async", "cannot parse kernel config"),
        ("flash_fwd__bf16__d128", "cannot parse kernel symbol"),
        ("nonsense", "cannot parse kernel config"),
    ],
)
def test_parse_errors_are_clear(text, match):
    with pytest.raises(ValueError, match=match):
        parse_config(text)


def test_invalid_config_error_lists_every_rule():
    with pytest.raises(ValueError) as exc:
        KernelConfig("bf16", 128, 256, 256, 1, q_frags=3)
    msg = str(exc.value)
    assert "block_q / num_warps must be at most 64" in msg
    assert "q_frags must be 0 or divide head_dim / 16" in msg
    assert "shared memory" in msg


def test_cpp_struct_uses_named_fields():
    src = KernelConfig("fp16", 64, 64, 128, 4, q_frags=0, k_frags=0, v_frags=1).cpp_struct("X")
    assert "static constexpr bool kIsBF16 = false;" in src
    assert "static constexpr int kBlockKV = 128;" in src
    assert "static constexpr int kVFrags = 1;" in src
    # One constant per field, plus the derived register split of a warp-specialized block.
    assert src.count("static constexpr") == len(KernelConfig.__dataclass_fields__) + 2
    assert "static constexpr int kProducerRegs = 0;" in src


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_default_config_covers_every_head_dim(dtype, causal):
    for head_dim in range(8, 257, 8):
        cfg = default_config(dtype, head_dim, causal, 1000, 1000)
        assert cfg.dtype == dtype
        assert cfg.head_dim == padded_head_dim(head_dim) >= head_dim
        assert not validity_errors(cfg)
    with pytest.raises(ValueError, match="head_dim must be at most 256"):
        padded_head_dim(264)


def _host_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.skipif(_host_compiler() is None, reason="needs a C++ compiler")
def test_python_rules_agree_with_static_asserts(tmp_path):
    """Compile fa::check_config for every candidate; exactly the Python-invalid ones must fail."""
    space = _space()
    lines = ['#include "fa/config_check.h"']
    for i, cfg in enumerate(space):
        lines.append(cfg.cpp_struct(f"C{i}").replace("\n", " "))
        lines.append(f"template struct fa::check_config<C{i}>;")
    src = tmp_path / "check.cpp"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [
            _host_compiler(),
            "-std=c++17",
            "-fsyntax-only",
            "-fmax-errors=0",
            f"-I{CSRC / 'include'}",
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    rejected = {int(m) for m in re.findall(r"check_config<C(\d+)>", proc.stdout + proc.stderr)}
    expected = {i for i, cfg in enumerate(space) if validity_errors(cfg)}
    assert expected, "the candidate space must contain invalid configs"
    assert rejected == expected, (
        f"C++ rejects but Python accepts: {sorted(rejected - expected)[:5]}; "
        f"Python rejects but C++ accepts: {sorted(expected - rejected)[:5]}"
    )


def test_wgmma_names_and_rules():
    cfg = wgmma_config("bf16", 128, 64, 128)
    assert cfg.name() == "(BF16, 128, 64, 128, 4): wgmma"
    deep = wgmma_config("fp16", 64, 128, 64, stages=2)
    assert deep.name() == "(FP16, 64, 128, 64, 8): wgmma+stages_2"
    assert parse_config(deep.symbol(True)) == deep
    # 1 KB of alignment slack on top of Q and the K/V ring.
    assert deep.smem_bytes == 2 * 64 * (128 + 2 * 64 * 2) + 1024
    with pytest.raises(ValueError, match="block_q = 16 \\* num_warps"):
        parse_config("(BF16, 128, 64, 128, 8): wgmma")
    with pytest.raises(ValueError, match="unknown flag 'buffer'"):
        parse_config("(BF16, 128, 64, 128, 4): wgmma+buffer")
    with pytest.raises(ValueError, match="stages other than 1 need wgmma"):
        KernelConfig("bf16", 128, 64, 64, 4, stages=2)
    with pytest.raises(ValueError, match="sm_90 limit"):
        wgmma_config("bf16", 256, 128, 128, stages=2)


def test_exp_poly_is_the_ws_forwards_named_off_by_default():
    """KernelConfig.exp_poly (kernel log 139): eighths of P's exponentials on the FMA pipe, fwd_ws only, off
    in every default; named ``+ep_N``, parsed back, and read by the kernel as Cfg::kExpPoly."""
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 16384):
                assert default_config("bf16", d, causal, n, n, "sm_90").exp_poly == 0
    cfg = ws_config("bf16", 64, 192, 128, 2, overlap=True).replace(exp_poly=4)
    assert cfg.name().endswith("+stages_2+ep_4") and parse_config(cfg.name()) == cfg
    assert parse_config(cfg.symbol(True)) == cfg and "kExpPoly = 4;" in kernel_source(cfg)
    assert "kExpPoly = 0;" in kernel_source(cfg.replace(exp_poly=0))
    with pytest.raises(ValueError, match="eighths"):
        cfg.replace(exp_poly=9)
    with pytest.raises(ValueError, match="exp_poly is the warp-specialized forward's"):
        wgmma_config("bf16", 128, 128, 128, 2).replace(exp_poly=2)
    with pytest.raises(ValueError, match="unknown flag"):
        parse_config(cfg.name().replace("ep_4", "ep_9"))


def test_warp_specialized_names_rules_and_register_split():
    cfg = ws_config("bf16", 128, 128, 128, 2)
    assert cfg.name() == "(BF16, 128, 128, 128, 12): wgmma+ws+stages_2"
    assert parse_config(cfg.name()) == cfg and parse_config(cfg.symbol(True)) == cfg
    assert (cfg.compute_warps, cfg.rows_per_warp) == (8, 16)
    # Two consumer warpgroups take what the producer gives back, within the 64K registers of an SM.
    producer, consumer = register_split(cfg)
    assert 128 * producer + 256 * consumer <= 384 * block_registers(cfg) and consumer > block_registers(cfg)
    assert register_split(ws_config("bf16", 128, 64, 128, 2)) == (0, 0)
    with pytest.raises(ValueError, match="warp_specialized needs wgmma, stages >= 2"):
        ws_config("bf16", 128, 128, 128, 1)
    with pytest.raises(ValueError, match="warp_specialized needs"):
        parse_config("(BF16, 128, 128, 128, 8): wgmma+ws+stages_2")
    src = kernel_source(cfg)
    assert "fa::FwdTmaParams p" in src and "__launch_bounds__(384, 1)" in src
    assert "kProducerRegs = 24" in src and "kConsumerRegs = 240" in src
    # setmaxnreg draws on the block's launch allocation: a split beyond it hangs the block.
    for cfg in (ws_config("bf16", 128, 128, 128, 2, persistent=True), ws_config("bf16", 64, 192, 128, 2)):
        producer, consumer = register_split(cfg)
        assert 128 * producer + (cfg.threads - 128) * consumer <= cfg.threads * block_registers(cfg)


def test_hopper_defaults_are_wgmma_and_others_are_not():
    for d in (64, 128, 192, 256):
        for causal in (False, True):
            for n in (512, 4096, 16384):
                assert default_config("bf16", d, causal, n, n, "sm_90").wgmma
                assert not default_config("bf16", d, causal, n, n, "sm_80").wgmma
                assert not default_config("bf16", d, causal, n, n).wgmma


def test_e4m3_configs_name_rules_and_shared_memory():
    cfg = ws_config("e4m3", 128, 128, 128, 2, overlap=True, persistent=True)
    assert cfg.name() == "(E4M3, 128, 128, 128, 12): wgmma+ws+overlap+persistent+stages_2"
    assert parse_config(cfg.name()) == cfg and parse_config(cfg.symbol()) == cfg
    # 1-byte Q (16 KB) and K/V ring (2 stages x 2 x 16 KB), the bf16 output's tile (32 KB), 1 KB for the
    # 1024-byte alignment, the ring's barriers.
    assert cfg.smem_bytes == 16384 + 65536 + 32768 + 1024 + 256
    # The kernels' flag for it, named by e4m3 configs alone (the 16-bit builds' structs stay as they were).
    assert "kIsE4M3 = true" in cfg.cpp_struct() and "kIsBF16 = true" in cfg.cpp_struct()
    assert "kIsE4M3" not in ws_config("bf16", 128, 128, 128, 2, overlap=True).cpp_struct()
    rule = "e4m3 needs the persistent warp-specialized forward, head_dim 64 or 128 on block_kv 128 or 256"
    # head_dim 64: its 64-byte rows of Q and K are one panel of the 64-byte swizzle
    assert not validity_errors(ws_config("e4m3", 64, 128, 128, 3, overlap=True, persistent=True))
    # head_dim 256 on 64-key tiles: V^T's rows one panel of the 64-byte swizzle
    assert not validity_errors(ws_config("e4m3", 256, 128, 64, 3, persistent=True))
    for bad in (
        ws_config("e4m3", 128, 128, 96, 2, persistent=True, check=False),  # V^T's 96-byte rows
        ws_config("e4m3", 192, 128, 128, 2, persistent=True, check=False),  # head_dim 192
        ws_config("e4m3", 128, 128, 128, 2, check=False),  # O staged in Q's tile
        wgmma_config("e4m3", 128, 128, 64, 2, check=False),  # the sm90 kernel
        ws_config("e4m3", 256, 128, 128, 2, persistent=True, check=False),  # head_dim 256 on 128 keys
        ws_config("e4m3", 128, 128, 64, 2, persistent=True, check=False),  # head_dim 128 on 64 keys
    ):
        assert any(e.startswith(rule) for e in validity_errors(bad)), bad.name()

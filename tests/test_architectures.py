"""configs/architectures.py: each GPU generation's facts in one entry, read by everything that depends on it
(the shared-memory limits, the wgmma families and their compile target, occupancy, precompiling)."""

from __future__ import annotations

import pytest

from flash_attention.configs import SMEM_OPTIN, hopper_bwd_config, is_hopper, smem_optin
from flash_attention.configs.architectures import ARCHITECTURES, architecture, runs_family
from flash_attention.jit.cache import target_arch
from flash_attention.ops.precompile import DeviceFacts
from flash_attention.tools.report import occupancy


def test_every_entry_is_coherent():
    for name, a in ARCHITECTURES.items():
        assert a.name == name and "portable" in a.families
        # An architecture-specific family needs the target it compiles for, and only those have one.
        assert (a.kernel_target is not None) == bool(a.families - {"portable"}), name
        assert 0 < a.smem_optin <= a.smem_per_sm - a.reserved_smem + 1024, name
        assert a.threads_per_sm % 32 == 0 and a.blocks_per_sm > 0 and a.sm_count > 0, name
        assert SMEM_OPTIN[name] == smem_optin(name) == a.smem_optin


def test_only_hopper_runs_the_wgmma_families_and_they_compile_for_its_target():
    assert [n for n in ARCHITECTURES if is_hopper(n)] == ["sm_90", "sm_90a"]
    assert runs_family("sm_90", "ws") and runs_family("sm_86", "portable")
    assert not runs_family("sm_89", "wgmma")
    cfg = hopper_bwd_config("bf16", 128)
    assert target_arch(cfg, "sm_90") == "sm_90a"
    with pytest.raises(ValueError, match="sm_90"):
        target_arch(cfg, "sm_80")


def test_an_unknown_architecture_gets_the_portable_kernels_within_the_smallest_limits():
    unknown = architecture("sm_100")
    assert unknown.families == {"portable"} and unknown.kernel_target is None and not is_hopper("sm_100")
    assert unknown.smem_optin == min(a.smem_optin for a in ARCHITECTURES.values())
    assert DeviceFacts.of_arch("sm_100").smem_limit == unknown.smem_optin
    assert DeviceFacts.of_arch("sm_90").sm_count == 132 and DeviceFacts.of_arch("sm_80").sm_count == 108


def test_occupancy_reads_the_multiprocessors_limits():
    # A 384-thread block of 168 registers fills an sm_90 multiprocessor's 64K registers; 1536 threads of an
    # sm_86 multiprocessor hold two 768-thread blocks, where an sm_80 one (2048) holds two as well but
    # three 640-thread ones.
    assert occupancy("sm_90", 384, 168, 200_000).blocks == 1
    assert occupancy("sm_86", 640, 32, 0).blocks == 2 and occupancy("sm_80", 640, 32, 0).blocks == 3
    assert occupancy("sm_86", 640, 32, 0).limiter == "threads"

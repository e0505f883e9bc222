"""The warp-specialized forward's machine code keeps the schedule its source asks for (kernel-log step 58).

In the overlapped loop a step's softmax must run while the previous step's P V is on the tensor cores:
its exponentials sit between the wait for S_j (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the wait for
P_{j-1} V_{j-1} (``gsb0, 0x0``). ptxas hoisted the second wait above them until the kernel pinned the order
(``order_before_wgmma_wait``); these tests compile the kernels (NVRTC or nvcc, for sm_90a) and read the SASS,
so a change that loses the order fails here, on the CPU, rather than as a few percent on a GPU. The build
with the old order (FA_NO_SOFTMAX_ORDER) shows the hoist, so the check can tell the two apart.
"""

from __future__ import annotations

import re

import pytest

from flash_attention.configs import parse_config
from flash_attention.jit import compiler
from flash_attention.jit.sources import kernel_source
from flash_attention.tools import report

pytestmark = [
    pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc"),
    pytest.mark.skipif(report.find_cuobjdump() is None, reason="needs cuobjdump"),
]

_WAIT_S = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1")
_WAIT_PV = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0")


def _exponentials_around_the_pv_wait(cfg_name: str, old_order: bool = False) -> list[tuple[int, int]]:
    """For each wait for S_j in the non-causal kernel: (MUFU.EX2 between it and the next wait for P V,
    MUFU.EX2 after that wait before the next HGMMA)."""
    cfg = parse_config(cfg_name)
    source = ("#define FA_NO_SOFTMAX_ORDER 1\n" if old_order else "") + kernel_source(cfg)
    result = compiler.compile_source(source, "sm_90a", cfg.name(), compiler.choose_compiler())
    sass = report.sass_by_function(result.cubin)[cfg.symbol(False)].splitlines()
    out = []
    for i, line in enumerate(sass):
        if not _WAIT_S.search(line):
            continue
        j = next(k for k in range(i + 1, len(sass)) if _WAIT_PV.search(sass[k]))
        after = next((k for k in range(j + 1, len(sass)) if "HGMMA" in sass[k]), len(sass))
        out.append((sum("MUFU.EX2" in x for x in sass[i:j]), sum("MUFU.EX2" in x for x in sass[j:after])))
    return out


@pytest.mark.parametrize(
    "cfg_name, per_step",
    [
        ("(BF16, 128, 128, 128, 12): wgmma+ws+overlap+persistent+stages_2", 64),
        ("(FP16, 256, 128, 80, 12): wgmma+ws+overlap+stages_2", 40),
    ],
)
def test_the_softmax_runs_before_the_wait_for_the_previous_product(cfg_name, per_step):
    steps = _exponentials_around_the_pv_wait(cfg_name)
    assert steps, "no overlapped loop found"
    for before, after in steps:
        assert before >= per_step and after == 0, steps


def test_without_the_pin_ptxas_hoists_the_wait():
    steps = _exponentials_around_the_pv_wait(
        "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+persistent+stages_2", old_order=True
    )
    assert steps and all(before < 64 for before, _ in steps), steps

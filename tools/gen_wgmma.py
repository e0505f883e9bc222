"""Write flash_attention/csrc/include/fa/wgmma_mma.cuh: the wgmma.mma_async wrappers, one per N.

An m64nNk16 instruction with fp32 accumulators names N / 2 accumulator registers in its operand list (128
at N = 256), which no one should type by hand. This script spells them out; tests/test_sm90.py checks the
committed header equals its output, so edit this file and rerun it:

    python tools/gen_wgmma.py
"""

from __future__ import annotations

import sys
from pathlib import Path

#: Every N a Hopper kernel may use: block_kv for S = Q K^T (any multiple of 16 in the warp-specialized
#: forward), head_dim for O += P V, and 8 for the bounded softmax's row sums, P against a tile of ones
#: (fa/softmax.cuh, csrc/kernels/sm90/fwd_ws).
NS = (8, *range(16, 257, 16))

HEADER = Path(__file__).resolve().parents[1] / "flash_attention/csrc/include/fa/wgmma_mma.cuh"


def _regs(first: int, count: int) -> str:
    return ", ".join(f"%{first + i}" for i in range(count))


def _acc_operands(count: int) -> str:
    return ", ".join(f'"+f"(d[{i}])' for i in range(count))


def _wrappers(n: int) -> str:
    acc = n // 2
    out = []
    for ab in ("bf16", "f16"):
        ss = (
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{_regs(0, acc)}}}, %{acc}, %{acc + 1}, "
            "p, 1, 1, 0, 0;"
        )
        ss_tt = (
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{_regs(0, acc)}}}, %{acc}, %{acc + 1}, "
            "p, 1, 1, 1, 1;"
        )
        ss_bt = (
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{_regs(0, acc)}}}, %{acc}, %{acc + 1}, "
            "p, 1, 1, 0, 1;"
        )
        rs = (
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{_regs(0, acc)}}}, "
            f"{{{_regs(acc, 4)}}}, %{acc + 4}, p, 1, 1, 1;"
        )
        out.append(
            f"template <>\nstruct Wgmma<{n}, {'true' if ab == 'bf16' else 'false'}> {{\n"
            f"  // A (64 x 16) and B (16 x {n}) both K-major in shared memory.\n"
            f"  static __device__ __forceinline__ void ss(float (&d)[{acc}], u64 a, u64 b,\n"
            "                                             int accumulate) {\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"\n'
            f'                 "{ss}\\n}}\\n"\n'
            f"                 : {_acc_operands(acc)}\n"
            f'                 : "l"(a), "l"(b), "r"(accumulate));\n'
            "  }\n"
            f"  // A (64 x 16) and B (16 x {n}) both MN-major (transposed) in shared memory.\n"
            f"  static __device__ __forceinline__ void ss_tt(float (&d)[{acc}], u64 a, u64 b,\n"
            "                                                int accumulate) {\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"\n'
            f'                 "{ss_tt}\\n}}\\n"\n'
            f"                 : {_acc_operands(acc)}\n"
            f'                 : "l"(a), "l"(b), "r"(accumulate));\n'
            "  }\n"
            f"  // A (64 x 16) K-major and B (16 x {n}) MN-major (transposed) in shared memory.\n"
            f"  static __device__ __forceinline__ void ss_bt(float (&d)[{acc}], u64 a, u64 b,\n"
            "                                                int accumulate) {\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"\n'
            f'                 "{ss_bt}\\n}}\\n"\n'
            f"                 : {_acc_operands(acc)}\n"
            f'                 : "l"(a), "l"(b), "r"(accumulate));\n'
            "  }\n"
            f"  // A in registers (the m64nNk16 A fragment), B ({n} columns) MN-major in shared memory.\n"
            f"  static __device__ __forceinline__ void rs_bt(float (&d)[{acc}], const u32 (&a)[4], u64 b,\n"
            "                                                int accumulate) {\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 5}, 0;\\n"\n'
            f'                 "{rs}\\n}}\\n"\n'
            f"                 : {_acc_operands(acc)}\n"
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));\n'
            "  }\n};\n"
        )
    return "\n".join(out)


def _e4m3_wrappers(n: int) -> str:
    """The 8-bit forms of N: both operands K-major (no transpose for 8-bit types), k = 32."""
    acc = n // 2
    ss = (
        f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{_regs(0, acc)}}}, %{acc}, %{acc + 1}, "
        "p, 1, 1;"
    )
    rs = (
        f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{_regs(0, acc)}}}, "
        f"{{{_regs(acc, 4)}}}, %{acc + 4}, p, 1, 1;"
    )
    return (
        f"template <>\nstruct WgmmaE4m3<{n}> {{\n"
        f"  // A (64 x 32) and B (32 x {n}) both K-major in shared memory.\n"
        f"  static __device__ __forceinline__ void ss(float (&d)[{acc}], u64 a, u64 b, int accumulate) {{\n"
        f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"\n'
        f'                 "{ss}\\n}}\\n"\n'
        f"                 : {_acc_operands(acc)}\n"
        f'                 : "l"(a), "l"(b), "r"(accumulate));\n'
        "  }\n"
        "  // A in registers (the m64nNk32 8-bit A fragment: four e4m3 a register),\n"
        f"  // B ({n} columns) K-major in shared memory.\n"
        f"  static __device__ __forceinline__ void rs(float (&d)[{acc}], const u32 (&a)[4], u64 b,\n"
        "                                             int accumulate) {\n"
        f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 5}, 0;\\n"\n'
        f'                 "{rs}\\n}}\\n"\n'
        f"                 : {_acc_operands(acc)}\n"
        f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));\n'
        "  }\n};\n"
    )


def render() -> str:
    parts = [
        "// Generated by tools/gen_wgmma.py -- do not edit; edit the script and rerun it.\n"
        "//\n"
        "// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} (PTX ISA 9.7.15.5.2), sm_90a only.\n"
        "// One warpgroup (4 consecutive warps) computes D (64 x N, fp32, N / 2 registers per thread)\n"
        "// += A (64 x 16) B (16 x N). `accumulate` = 0 ignores D's old value (scale-d false): the first\n"
        "// k-step needs no zeroed registers.\n"
        "// The instruction is asynchronous: the caller brackets it with wgmma_fence / wgmma_commit /\n"
        "// wgmma_wait<> (fa/wgmma.cuh) and reads D only after the wait.\n"
        "#pragma once\n\n"
        '#include "fa/ptx.cuh"\n\n'
        "namespace fa {\n\n"
        "template <int N, bool kIsBF16>\nstruct Wgmma;\n"
    ]
    parts += [_wrappers(n) for n in NS]
    parts.append(
        "// wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3: FP8 (e4m3) operands, fp32\n"
        "// accumulators, D += A (64 x 32) B (32 x N). 8-bit operands are K-major only (the PTX ISA\n"
        "// allows the transpose for 16-bit types alone), so O += P V reads V transposed\n"
        "// (docs/fp8-study.md, A.3.1).\n"
        "template <int N>\nstruct WgmmaE4m3;\n"
    )
    parts += [_e4m3_wrappers(n) for n in NS]
    parts.append("}  // namespace fa\n")
    return "\n".join(parts)


def main() -> int:
    HEADER.write_text(render())
    print(f"wrote {HEADER}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

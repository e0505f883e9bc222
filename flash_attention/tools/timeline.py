"""The timeline builds' records (csrc/include/fa/timeline.cuh), for tools/ws_timeline.py (the
warp-specialized forward) and tools/bwd_timeline.py (the warp-specialized backward's dK/dV kernel): the
build itself, the record buffer's shape, its events read back by (block, warp), and the CSV both write.

A record is 16 bytes, (kind << 32 | argument, clock64); warp w of block b writes records
(b * WARPS + w) * RECORDS onwards, and an all-zero record ends a warp's list.
"""

from __future__ import annotations

import sys

#: fa/timeline.cuh's kBlocks, kWarps, kRecords.
BLOCKS, WARPS, RECORDS = 4, 16, 4096


def compile_timeline_build(cfg, arch: str, defines: tuple[str, ...] = ("FA_TIMELINE",)):
    """``cfg``'s translation unit compiled with each of ``defines`` set to 1 ahead of its source, loaded:
    the library to take entry points from (jit.driver.get_kernel). Says so on stderr if a kernel spills."""
    from flash_attention.jit import compiler, driver
    from flash_attention.jit.cache import target_arch
    from flash_attention.jit.sources import kernel_source

    source = "".join(f"#define {d} 1\n" for d in defines) + kernel_source(cfg)
    kind = compiler.choose_compiler()
    result = compiler.compile_source(
        source, target_arch(cfg, arch), f"{cfg.name()} ({', '.join(defines)})", kind
    )
    spills = [r for r in result.resources if getattr(r, "spill_stores", 0)]
    if spills:
        print(f"note: the {'+'.join(defines)} build spills ({spills[0]})", file=sys.stderr)
    return driver.load_library(result.cubin)


def events(raw, kinds: dict[int, str]) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """(block, warp) -> [(kind's name, argument, cycle)] in recorded order, from a (BLOCKS, WARPS, RECORDS, 2)
    int64 buffer; a kind missing from ``kinds`` keeps its number as its name."""
    out = {}
    for b in range(raw.shape[0]):
        for w in range(raw.shape[1]):
            seq = []
            for head, cycle in raw[b, w].tolist():
                if head == 0:
                    break
                seq.append((kinds.get(head >> 32, str(head >> 32)), head & 0xFFFFFFFF, cycle))
            if seq:
                out[(b, w)] = seq
    return out


def median_text(xs) -> str:
    """A median as a 7-wide column of cycles, or a dash for none."""
    import statistics

    return f"{statistics.median(xs):7.0f}" if xs else "      -"


def write_csv(path: str, ev: dict[tuple[int, int], list[tuple[str, int, int]]]) -> None:
    with open(path, "w") as f:
        f.write("block,warp,kind,argument,cycle\n")
        for (b, w), seq in sorted(ev.items()):
            for kind, arg, cycle in seq:
                f.write(f"{b},{w},{kind},{arg},{cycle}\n")

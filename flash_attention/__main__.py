"""``python -m flash_attention [command]``.

Without a command: the main job (our attention against PyTorch's on a default shape; without a GPU, the
CPU path's error and time against SDPA's, and what to run next). Commands hand the rest of the command
line to their own parser, so ``--help`` after a command is that command's help. Each command is a module of
:mod:`flash_attention.tools`, imported only when chosen (so ``bench --update-readme`` and ``build`` need
nothing a GPU machine has).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _bench(argv: list[str]) -> int:
    from flash_attention.tools.bench import main as bench_main

    return bench_main(argv)


def _build(argv: list[str]) -> int:
    from flash_attention.tools.build import main as build_main

    return build_main(argv)


def _autotune(argv: list[str]) -> int:
    from flash_attention.tools.autotune import main as autotune_main

    return autotune_main(argv)


def _report(argv: list[str]) -> int:
    from flash_attention.tools.report import main as report_main

    return report_main(argv)


def _demo(argv: list[str]) -> int:
    from flash_attention.tools.demo import main as demo_main

    return demo_main(argv)


def _debug(argv: list[str]) -> int:
    from flash_attention.tools.debug import main as debug_main

    return debug_main(argv)


def _sanity(argv: list[str]) -> int:
    from flash_attention.tools.sanity import main as sanity_main

    return sanity_main(argv)


# name -> (one-line help, handler). Handlers import their module only when chosen: `bench --update-readme`
# and `build` must work on machines where other tools' imports (CUDA, Triton) would fail or be slow.
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "bench": ("benchmark against PyTorch's attention backends; write benchmarks/results/*.json", _bench),
    "build": ("pre-compile every kernel a model can need (--arch sm_80,sm_90; --list)", _build),
    "demo": ("Transformer encoder with stock vs our attention: time and GPU memory by seqlen", _demo),
    "autotune": ("time every surviving kernel config per shape class and cache the winners", _autotune),
    "report": (
        "registers, smem, spills, occupancy, SASS counts (--sass), step loops (--loop)",
        _report,
    ),
    "debug": ("trace one warp of a kernel and of the tile simulator; name the first difference", _debug),
    "sanity": ("check GPU, compiler and cache; compile and run one kernel against the reference", _sanity),
}


def _parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<8} {help_}" for name, (help_, _) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="python -m flash_attention",
        description=(
            "Without a command: run flash_attention.attention against PyTorch's attention on a default shape "
            "and print time, TFLOP/s and max error against a float64 reference (on a machine without a CUDA "
            "GPU: the CPU path's max error and time, each beside SDPA's, then the next steps)."
        ),
        epilog=f"commands:\n{lines}\n\n`python -m flash_attention COMMAND --help` explains each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Dispatch on the first word by hand rather than through argparse subparsers: argparse would try to
    # parse the command's own options (and its --help) before the command sees them.
    if args and args[0] in COMMANDS:
        return int(COMMANDS[args[0]][1](args[1:]) or 0)
    parser = _parser()
    if args and not args[0].startswith("-"):
        parser.error(f"unknown command {args[0]!r}; choose from {', '.join(COMMANDS)}")
    parser.parse_args(args)

    from flash_attention.tools.bench.main_job import run_main_job

    return run_main_job()


if __name__ == "__main__":
    sys.exit(main())

"""The repository's scripts under tools/ (not a package) as modules, for the tests that check them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timeline_buffer(tool: ModuleType, per_warp: dict):
    """A timeline build's record buffer (flash_attention.tools.timeline) holding ``per_warp``'s events:
    (block, warp) -> [(kind's name in ``tool.EVENTS``, argument, cycle)], for the tests of the
    tools/*_timeline.py scripts."""
    import torch

    raw = torch.zeros(tool.BLOCKS, tool.WARPS, tool.RECORDS, 2, dtype=torch.int64)
    kinds = {name: k for k, name in tool.EVENTS.items()}
    for (block, warp), events in per_warp.items():
        for i, (name, arg, cycle) in enumerate(events):
            raw[block, warp, i, 0] = kinds[name] << 32 | arg
            raw[block, warp, i, 1] = cycle
    return raw

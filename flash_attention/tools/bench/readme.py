"""The README regions generated from result files: ``<!-- bench:begin -->`` for the forward sweep and
``<!-- bench-<mode>:begin -->`` for a training-mode sweep or a decode run (``bench-decode``), with
``-d<head_dim>`` (and ``-dv<head_dim_v>``) after the mode for a training sweep of one head_dim outside the
papers' grid (``bench-fwd_bwd-d192-dv128``: DeepSeek's widths). A region is
only ever generated from a result file whose code was exactly its commit's
(:func:`flash_attention.tools.provenance.check_result`)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import provenance
from ..common import generated_by, replace_marked_region, repo_root
from .decode import decode_markdown
from .results import load_results, result_mode
from .ring import ring_markdown
from .sweep import DEFAULT_HEAD_DIMS
from .tables import results_header, results_to_markdown

__all__ = ["README_BEGIN", "README_END", "readme_markers", "update_readme"]

README_BEGIN = "<!-- bench:begin -->"
README_END = "<!-- bench:end -->"


def update_readme(readme_path: str | os.PathLike, results_path: str | os.PathLike) -> str:
    """Replace the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` (for a training-mode
    result, its own markers: :func:`readme_markers`) with a result's tables.

    Returns the new block. The markers stay; everything outside them is left byte for byte. A PNG plot with
    the result file's name next to it (``--plot``) is embedded when present. Raises
    :class:`~flash_attention.tools.provenance.ProvenanceError` (a ValueError) for a file that cannot be tied
    to the code of its commit.
    """
    readme_path, results_path = Path(readme_path), Path(results_path)
    result = load_results(results_path)
    provenance.check_result(result, repo_root(), str(results_path))
    begin, end = readme_markers(result)
    rel = os.path.relpath(results_path.resolve(), readme_path.resolve().parent).replace(os.sep, "/")
    block = [
        results_header(result, rel),
        "",
        generated_by("bench", results_path, readme_path),
        "",
    ]
    # The plots `bench --plot` writes beside the result file, one per head_dim.
    for plot in sorted(
        results_path.parent.glob(f"{results_path.stem}-d*.png"), key=lambda p: int(p.stem.rsplit("-d", 1)[1])
    ):
        plot_rel = os.path.relpath(plot.resolve(), readme_path.resolve().parent).replace(os.sep, "/")
        what = "Time and memory" if result_mode(result) == "ring" else "TFLOP/s"
        block += [f"![{what} by sequence length, {plot.stem.rsplit('-', 1)[1]}]({plot_rel})", ""]
    mode = result_mode(result)
    if mode == "decode":
        table = decode_markdown(result)
    elif mode == "ring":
        table = ring_markdown(result)
    else:
        table = results_to_markdown(result)
    block.append(table.rstrip("\n"))
    new_block = "\n".join(block)
    replace_marked_region(readme_path, begin, end, new_block)
    return new_block


def readme_markers(result: dict) -> tuple[str, str]:
    """The README region a result file's tables go to: ``<!-- bench:begin -->`` for a file with forward
    rows, ``<!-- bench-<mode>:begin -->`` for one that measured only a training mode (fwd_bwd or bwd), so the
    forward and training tables are generated from their own runs side by side;
    ``<!-- bench-tiny-<mode>:begin -->`` for a ``--tiny`` run of that mode; a training sweep of one head_dim
    outside the papers' grid (64, 128, 256) has a region of its own, ``<!-- bench-<mode>-d<head_dim>:begin
    -->``, with ``-dv<head_dim_v>`` where v has its own (``--head-dim-v``): it does not replace the grid's."""
    mode = result_mode(result)
    settings = result.get("settings") or {}
    if settings.get("tiny"):
        return f"<!-- bench-tiny-{mode}:begin -->", f"<!-- bench-tiny-{mode}:end -->"
    if mode == "fwd":
        return README_BEGIN, README_END
    head_dims = {r.get("head_dim") for r in result.get("rows", [])}
    if mode in ("fwd_bwd", "bwd") and len(head_dims) == 1 and not head_dims <= set(DEFAULT_HEAD_DIMS):
        dv = settings.get("head_dim_v")
        name = f"{mode}-d{head_dims.pop()}" + (f"-dv{dv}" if dv else "")
        return f"<!-- bench-{name}:begin -->", f"<!-- bench-{name}:end -->"
    return f"<!-- bench-{mode}:begin -->", f"<!-- bench-{mode}:end -->"

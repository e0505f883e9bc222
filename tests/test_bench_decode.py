"""``bench --mode decode`` without a GPU: its options, and the tables built from a result file (ratios and the
share of the copy bandwidth computed from the rows, baselines matched to our rows by point)."""

from __future__ import annotations

import pytest

from flash_attention.tools.bench.cli import build_parser
from flash_attention.tools.bench.decode import decode_markdown, decode_text


def _row(impl, batch, keys, page, ms, seqlen_q=1):
    kv_bytes = 2 * batch * keys * 8 * 128 * 2
    return dict(
        impl=impl, mode="decode", dtype="bf16", head_dim=128, causal=seqlen_q > 1, seqlen=keys, seqlen_k=keys,
        seqlen_q=seqlen_q, batch=batch, heads=32, heads_kv=8, page_size=page, ms=ms,
        tb_s=kv_bytes / (ms * 1e-3) / 1e12, tflops=1.0,
    )  # fmt: skip


def test_options_parse():
    args = build_parser().parse_args(
        [
            "--mode",
            "decode",
            "--batches",
            "1,8",
            "--page-sizes",
            "0,16",
            "--seqlens",
            "1k,32k",
            "--seqlens-q",
            "1,4",
        ]
    )
    assert args.mode == "decode" and args.batches == (1, 8) and args.page_sizes == (0, 16)
    assert args.seqlens == (1024, 32768) and args.seqlens_q == (1, 4) and args.num_splits == 0
    assert build_parser().parse_args(["--mode", "decode", "--num-splits", "1"]).num_splits == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--mode", "decode", "--page-sizes", "-1"])


def test_tables_compare_each_point_with_the_baselines_contiguous_time():
    rows = [
        _row("flash_attention", 8, 32768, 0, 0.40),
        _row("flash_attention", 8, 32768, 16, 0.50),
        _row("sdpa_cudnn", 8, 32768, 0, 0.50),
        _row("flash_attention", 8, 32768, 0, 0.60, seqlen_q=4),
    ]
    result = dict(gpu="Test GPU", copy_tb_s=3.0, rows=rows)
    text = decode_text(result)
    lines = [line.split() for line in text.splitlines()[3:]]
    assert len(lines) == 3  # our three points; the baseline is a column
    contiguous, paged, spec = lines
    assert contiguous[-1] == "0.80×" and paged[-1] == "1.00×"  # 0.40 / 0.50 and 0.50 / 0.50
    tb = 2 * 8 * 32768 * 8 * 128 * 2 / 0.40e-3 / 1e12
    assert contiguous[5] == f"{tb:.2f}" and contiguous[6] == f"{tb / 3.0:.0%}"
    assert spec[0] == "4" and spec[-1] == "–"  # no baseline at seqlen_q 4
    md = decode_markdown(result)
    assert md.startswith("### Decode (bf16, 32/8 heads, head_dim 128, Test GPU; device copy 3.00 TB/s)")
    assert md.count("\n| ") == 5  # header, rule, three rows


def test_decode_results_go_to_their_own_readme_region(tmp_path, monkeypatch):
    from flash_attention.tools import provenance
    from flash_attention.tools.bench.readme import README_BEGIN, README_END, update_readme
    from flash_attention.tools.bench.results import write_results

    # The synthetic result names no real commit: the provenance check (tests/test_bench.py) is switched off.
    monkeypatch.setattr(provenance, "check_result", lambda result, repo, what: None)
    readme = tmp_path / "README.md"
    decode = "<!-- bench-decode:begin -->\nstale\n<!-- bench-decode:end -->\n"
    text = f"{README_BEGIN}\nforward\n{README_END}\n{decode}"
    readme.write_text(text)
    result = dict(
        gpu="Test GPU", driver="1", cuda="13.0", torch="2.11", commit="abc1234", matmul_tflops=None,
        copy_tb_s=3.0, date="2026-11-23",
        rows=[_row("flash_attention", 8, 32768, 0, 0.40), _row("sdpa_cudnn", 8, 32768, 0, 0.50)],
    )  # fmt: skip
    update_readme(readme, write_results(result, tmp_path / "r-decode.json"))
    new = readme.read_text()
    assert "forward" in new and "stale" not in new  # the forward region is left alone
    block = new.split("<!-- bench-decode:begin -->")[1]
    assert "1 GiB device-to-device copy in the same run: 3.00 TB/s" in block and "0.80×" in block


def test_plain_attention_is_timed_on_the_same_cache_as_a_decode_call(monkeypatch):
    # `flash_attention.attention` rows: attention() on the contiguous cache's tensors, causal aligned to the
    # last key (as the cache's call is) when there is more than one query; the table shows it beside ours.
    import torch

    import flash_attention
    from flash_attention.tools.bench import decode

    assert decode.PLAIN_CALL in decode.DECODE_IMPLS
    seen = []
    monkeypatch.setattr(flash_attention, "attention", lambda q, k, v, **kw: seen.append((q, k, v, kw)))
    q = torch.randn(2, 4, 8, 16)
    k, v = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    fn, _ = decode._call(decode.PLAIN_CALL, [q], [(k, v, None)], torch.full((2,), 64))
    fn(0)
    (got,) = seen
    assert got[0] is q and got[1] is k and got[2] is v and got[3] == {"causal": True}
    rows = [_row("flash_attention", 8, 32768, 0, 0.40), _row(decode.PLAIN_CALL, 8, 32768, 0, 0.80)]
    text = decode_text(dict(gpu="Test GPU", copy_tb_s=3.0, rows=rows))
    assert "flash_attention.attention µs" in text and text.splitlines()[-1].split()[-1] == "0.50×"


def test_the_decode_grid_times_plain_attention_and_the_baselines_at_every_query_count():
    # Without --impls the grid times plain attention() beside ours and SDPA (the sweeps' default names no
    # plain call, which once left it out of the grid); --impls narrows it, and names the plain call.
    from flash_attention.tools.bench import decode
    from flash_attention.tools.bench.cli import decode_impls

    default = build_parser().parse_args(["--mode", "decode"]).impls
    assert decode_impls(default) == decode.DECODE_IMPLS and decode.PLAIN_CALL in decode_impls(default)
    named = "flash_attention.attention,sdpa_cudnn"
    picked = build_parser().parse_args(["--mode", "decode", "--impls", named])
    assert decode_impls(picked.impls) == ("sdpa_cudnn", decode.PLAIN_CALL)
    # A contiguous cache: all of them, whatever seqlen_q; a paged one: ours alone.
    assert decode.impls_at(decode.DECODE_IMPLS, 0) == list(decode.DECODE_IMPLS)
    assert decode.impls_at(decode.DECODE_IMPLS, 16) == ["flash_attention"]

"""The README's examples (and docs/usage.md's) run as written on this machine's device, the README's
commands are the ones CI runs, and the docs' links point at files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
USAGE = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")


def _section_code(heading: str, text: str = README) -> str:
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_use_example_runs_as_written():
    scope: dict = {}
    exec(compile(_section_code("Use"), "README.md (Use)", "exec"), scope)  # noqa: S102 - our own README
    q, out, lse = scope["q"], scope["out"], scope["lse"]
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 32, 1024)
    assert out.isfinite().all()


def test_the_use_example_states_sdpas_equivalent_of_our_causal_mask():
    # attention(causal=True) is bottom-right aligned, SDPA's is_causal=True top-left: the README's first
    # example gives SDPA's equivalent of ours. Run its two statements again on seqlen_q < seqlen_k, where
    # the alignments differ, and on seqlen_q > seqlen_k without the rows that see no key (SDPA gives NaN).
    from flash_attention import attention

    code = _section_code("Use")
    equivalent = code[code.index("mask = ") :]
    for seqlen_q, seqlen_k in ((37, 101), (90, 64)):
        q, k, v = (
            torch.randn(2, n, h, 16, dtype=torch.float64)
            for n, h in ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2))
        )
        scope = {"torch": torch, "q": q, "k": k, "v": v, "device": "cpu"}
        exec(compile(equivalent, "README.md (Use)", "exec"), scope)  # noqa: S102 - our own README
        ours = attention(q, k, v, causal=True)
        rows = slice(max(0, seqlen_q - seqlen_k), None)
        torch.testing.assert_close(scope["sdpa_out"][:, rows], ours[:, rows])
        top_left = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
        assert (top_left[:, rows] - ours[:, rows]).abs().max() > 0.1


def test_the_install_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e . && python -m flash_attention" in README
    assert 'pip install -e ".[test]" && pytest' in README
    assert "--index-url https://download.pytorch.org/whl/cpu" in README
    # The README names the full tier next to the default test command, and CI runs it.
    assert "`pytest --full`" in README
    for line in (
        "python -m pip install --quiet -e .",
        "python -m flash_attention",
        'pip install --quiet -e ".[test]"',
        "python -m pytest --full\n",
    ):
        assert line in ci


def _collected(*args: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_plain_pytest_leaves_the_compile_sweep_to_pytest_full():
    files = ["tests/test_build.py", "tests/test_arch_defaults.py"]
    default, full = _collected(*files), _collected("--full", *files)
    sweep = {
        "tests/test_build.py::test_build_command_compiles_every_kernel_a_model_can_need",
        "tests/test_arch_defaults.py::test_defaults_of_the_99_kb_architectures_compile_without_spills[sm_86]",
    }
    assert sweep <= full and not sweep & default
    # The default tier keeps a compile of each kernel family with its resource report.
    assert "tests/test_build.py::test_build_command_compiles_a_kernel_of_every_family" in default
    assert default < full


def test_the_kvcache_example_runs_as_written():
    scope: dict = {}
    exec(compile(_section_code("Use"), "README.md (Use)", "exec"), scope)  # noqa: S102 - our own README
    code = _section_code("Decoding with a KV cache", USAGE)
    exec(compile(code, "docs/usage.md (Decoding with a KV cache)", "exec"), scope)  # noqa: S102
    out, k_cache, lengths = scope["out"], scope["k_cache"], scope["lengths"]
    assert out.shape == (2, 1, 32, 128) and out.isfinite().all()
    assert lengths.tolist() == [101, 7001]
    # Row 1's new token went to position 7000: page block_table[1, 7000 // 256] = 32 + 27, slot 88.
    assert torch.equal(k_cache[59, 88], scope["k_new"][1, 0])


def test_the_docs_links_point_at_files_that_exist():
    # Relative links of the README and docs/, the kernel log's family files included (an index page renders
    # them from the checkout's tree).
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_the_readme_stays_short():
    assert README.count("\n") <= 250

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

#: The full tier's marker: tests that compile every kernel for each architecture, the longest silent part
#: of the suite on a CPU machine (the README gives the times), so plain `pytest` leaves them out and
#: `pytest --full` (what CI runs) adds them.
FULL = "full_build"


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help=f"also run the tests marked {FULL}: the compile of every kernel a model can need for sm_80 and "
        "sm_90, and of every default for sm_86 and sm_89 (CI runs it)",
    )


def _full_tier(config) -> bool:
    # `-m full_build` (or any expression naming the marker) asks for the tier as plainly as --full does.
    return config.getoption("--full") or FULL in (config.getoption("markexpr") or "")


def pytest_configure(config):
    # Under pytest-xdist (-n N) every worker's torch would use all cores for its CPU work (the simulator,
    # the float64 references), N times oversubscribing the machine: with 16 workers on 16 cores the
    # simulator tests ran ten times slower than alone. Each worker takes its share.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_report_header(config):
    if not _full_tier(config):
        return f"tests marked {FULL} (every kernel compiled for each architecture) deselected: pytest --full"


def pytest_sessionstart(session):
    # A first call builds the C++ host library in the background and takes the Python path meanwhile
    # (flash_attention.jit.host): on a GPU the tests that expect its native paths get it built first.
    if torch.cuda.is_available():
        from flash_attention.jit import host

        host.unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if not _full_tier(config):
        full = [item for item in items if FULL in item.keywords]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if FULL not in item.keywords]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability 8.0 or newer")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def key_range_calls(monkeypatch):
    """Spy on the attention() calls of the modules' padded route: each call given a ``key_range``.

    Records a CPU copy of every ``key_range`` tensor passed to ``flash_attention.attention`` by
    flash_attention.nn.functional (the one place the modules and the transformers integration call it with
    key ranges), with the shapes of q and k: ``calls["key_range"]`` is the list of (q shape, k shape,
    causal, key_range) tuples, ``calls["plain"]`` counts the calls without key_range.
    """
    from flash_attention.nn import functional as fn

    calls = {"key_range": [], "plain": 0}
    real = fn.attention

    def spy(q, k, v, **kwargs):
        kr = kwargs.get("key_range")
        if kr is None:
            calls["plain"] += 1
        else:
            calls["key_range"].append((tuple(q.shape), tuple(k.shape), kwargs.get("causal", False), kr.cpu()))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fn, "attention", spy)
    return calls


@pytest.fixture
def force_key_range(monkeypatch, key_range_calls):
    """Make the CPU take the key-range route for padded calls (as CUDA does), and spy on its calls.

    The seam is ``kernel_expected``: with it True, padded calls whose valid keys are one run per row go to
    attention(..., key_range=), whose PyTorch fallback computes the key ranges exactly as the kernel does.
    """
    from flash_attention.nn import functional as fn

    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    return key_range_calls


def _build_command(config, args: list[str], cache: str, **extra_env: str):
    """Run ``python -m flash_attention build ARGS`` into the kernel cache ``cache``; returns the process (its
    stderr merged into stdout) and the cache's metadata files.

    Its progress lines go to the terminal as they come: pytest would otherwise hold the output until the
    fixture returns, and a build of every kernel is minutes of silence.
    """
    from flash_attention.jit import compiler

    kind = "nvrtc" if compiler.load_nvrtc() is not None else "nvcc" if compiler.find_nvcc() else None
    if kind is None:
        pytest.skip("needs NVRTC (pip: nvidia-cuda-nvrtc) or nvcc")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    env = dict(os.environ, FLASH_ATTENTION_CACHE_DIR=cache, FLASH_ATTENTION_QUIET="1", **extra_env)
    cmd = [sys.executable, "-m", "flash_attention", "build", *args, "--compiler", kind]
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        watchdog = threading.Timer(1800, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                progress = line.startswith(("building ", "[", "PROBLEM")) or " built in " in line
                if progress and reporter is not None:
                    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                        reporter.write_line(line.rstrip())
        finally:
            watchdog.cancel()
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout="".join(lines), stderr="")
    metas = [json.loads(p.read_text()) for p in Path(cache).glob("*.json")]
    return done, metas


@pytest.fixture(scope="session")
def family_builds(request, tmp_path_factory):
    """``python -m flash_attention build --strict`` of :func:`family_sample` for sm_90 (the one architecture
    that runs every family): the default tier's compile of the shipped kernels with their resource report,
    in well under a minute. The host library is left out (test_host_library.py builds it)."""
    from kernel_families import family_sample

    names = [job.cfg.name() for job in family_sample()]
    cache = str(tmp_path_factory.mktemp("families"))
    args = ["--arch", "sm_90", "--strict", "--configs", *names]
    return _build_command(request.config, args, cache, FLASH_ATTENTION_HOST_LIBRARY="0")


@pytest.fixture(scope="session")
def catalog_builds(request, tmp_path_factory):
    """``python -m flash_attention build --strict`` for sm_80 and sm_90, once per session: every kernel a
    model can need, compiled by NVRTC (what users compile with) or, without it, nvcc. Returns the process
    and the cache's metadata files. Minutes on a CPU machine: only tests marked full_build use it."""
    if not _full_tier(request.config):
        pytest.fail(f"catalog_builds compiles every kernel: mark the test that uses it @pytest.mark.{FULL}")
    cache = str(tmp_path_factory.mktemp("catalog"))
    return _build_command(request.config, ["--arch", "sm_80,sm_90", "--strict"], cache)


@pytest.fixture
def validations(monkeypatch) -> list:
    """Every call of attention()'s whole path (its validation), as the q shape it was given: a call that
    repeats an earlier one's launch (ops.repeat) adds nothing."""
    from flash_attention.api import attention as interface

    seen: list = []
    real = interface.validate

    def spy(q, *args, **kwargs):
        seen.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(interface, "validate", spy)
    return seen

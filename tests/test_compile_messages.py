"""What a compile tells the person waiting (jit/cache.py _Ticker, issue 49): nothing for a compile under a
second, one line with what it was and how long it took for a longer one, and progress lines while a long
one runs; FLASH_ATTENTION_QUIET=1 silences all of it."""

from __future__ import annotations

import time

import pytest

from flash_attention.jit import cache


def _compile(seconds: float, **kwargs) -> None:
    with cache._Ticker("K for sm_90 with nvrtc 13.0", **kwargs):
        time.sleep(seconds)


def test_a_short_compile_says_nothing(capsys, monkeypatch):
    monkeypatch.delenv("FLASH_ATTENTION_QUIET", raising=False)
    _compile(0.05)
    assert capsys.readouterr().err == ""


def test_a_compile_of_a_second_or_more_says_what_and_how_long_on_one_line(capsys, monkeypatch):
    monkeypatch.delenv("FLASH_ATTENTION_QUIET", raising=False)
    _compile(0.15, quiet_under=0.1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("flash_attention: compiled K for sm_90 with nvrtc 13.0 in ")
    assert float(lines[0].split(" in ")[1].removesuffix(" s")) >= 0.1


def test_a_long_compile_says_it_is_still_running(capsys, monkeypatch):
    monkeypatch.delenv("FLASH_ATTENTION_QUIET", raising=False)
    _compile(0.5, quiet_under=0.1, first=0.1, every=0.15)
    lines = capsys.readouterr().err.splitlines()
    still = [x for x in lines if x.startswith("flash_attention: still compiling K for sm_90")]
    assert 2 <= len(still) <= 4 and lines[-1].startswith("flash_attention: compiled K")


@pytest.mark.parametrize("seconds", [0.05, 0.3])
def test_quiet_silences_every_message(capsys, monkeypatch, seconds):
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    _compile(seconds, quiet_under=0.0, first=0.1, every=0.1)
    assert capsys.readouterr().err == ""

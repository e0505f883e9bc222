"""Spies for the transformers integration's tests: count the calls that reach a function, by a key of the
caller's choosing, while the real function still runs."""

from __future__ import annotations

from collections.abc import Callable


def count_calls(monkeypatch, owner, name: str, seen: dict, key: str | Callable[[dict], str]) -> None:
    """Replace ``owner.name`` with a spy that adds 1 to ``seen[key]`` per call (``key`` a function of the
    call's keyword arguments picks the entry per call) and runs the real function."""
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        seen[key(kwargs) if callable(key) else key] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def count_sdpa(monkeypatch, seen: dict, key: str = "sdpa") -> None:
    """Count transformers' own SDPA attention function's calls in ``seen[key]``."""
    from transformers.integrations import sdpa_attention

    count_calls(monkeypatch, sdpa_attention, "sdpa_attention_forward", seen, key)

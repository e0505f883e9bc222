"""Spies for the transformers integration's tests: count the calls that reach a function, by a key of the
caller's choosing, while the real function still runs."""

from __future__ import annotations

import collections
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


def count_routes(monkeypatch) -> dict:
    """Count the transformers integration's attention calls per route in the returned dict: a kernel
    route's key names the function called (``attention``, directly or through the key-mask route, or
    ``attention_with_kvcache``) with the window and the soft-cap it was given, e.g. ``"attention
    window=(7, 0) softcap=2.0"``; ``"sdpa"`` and ``"eager"`` count the calls that left the kernels."""
    from flash_attention.integrations import transformers as integration
    from flash_attention.nn import functional as fn

    seen: dict = collections.defaultdict(int)

    def kernel(name: str) -> Callable[[dict], str]:
        return lambda kwargs: f"{name} window={kwargs.get('window')} softcap={kwargs.get('softcap')}"

    count_calls(monkeypatch, integration, "attention", seen, kernel("attention"))
    count_calls(monkeypatch, fn, "attention", seen, kernel("attention"))
    count_calls(monkeypatch, integration, "attention_with_kvcache", seen, kernel("attention_with_kvcache"))
    count_calls(monkeypatch, integration, "_eager_attention", seen, "eager")
    count_sdpa(monkeypatch, seen)
    return seen

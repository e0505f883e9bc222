"""The exception of an implementation that cannot run a bench point (its own module, so that every runner
module, bench/runners.py and bench/fa4.py alike, can raise it without importing the other)."""

from __future__ import annotations

__all__ = ["Skip"]


class Skip(Exception):
    """An implementation cannot run this point; the message says why."""

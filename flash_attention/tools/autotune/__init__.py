"""``python -m flash_attention autotune``: measure every surviving candidate configuration per shape class and
write the winners to the cache the launch layer reads (:mod:`flash_attention.ops.winners`).

* :mod:`.space` -- the candidates of each family and the pruning rules;
* :mod:`.loop` -- compile-and-check, timing, and the loop over shape classes, shared by both families;
* :mod:`.forward` / :mod:`.backward` -- each family's check and timing;
* :mod:`.cli` -- the command line.
"""

from .cli import main

__all__ = ["main"]

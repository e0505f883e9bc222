"""Run a test body in several spawned processes, one per rank of a torch.distributed group (the ring
attention tests, on gloo and on NCCL)."""

from __future__ import annotations

import os
import signal
import tempfile
import warnings
from pathlib import Path

import torch.multiprocessing as mp

#: Where a rank records that it finished its work (leave_group), for spawn_ranks to read.
_DONE_DIR = "FLASH_ATTENTION_TEST_RANKS_DONE"


def leave_group(dist) -> None:
    """Leave the group once every rank is done: record that this rank finished (every check of its body
    passed), then a barrier and the group's teardown. A rank that tore its gloo group down while a peer's
    last sends were still in flight aborted that peer ("terminate called without an active exception", exit
    code -6), seen in CPU suite runs even after the barrier: spawn_ranks accepts that exit only from a rank
    that recorded it was done."""
    done_dir = os.environ.get(_DONE_DIR)
    if done_dir:
        open(os.path.join(done_dir, f"rank{dist.get_rank()}"), "w").close()
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(target, world: int, tmp_path, *args, timeout: float = 120) -> None:
    """Run ``target(rank, world, init_file, *args, failures)`` in ``world`` spawned processes; fail with
    every rank's traceback if any of them raised (each puts its traceback in ``failures``), and unless
    every rank exited 0 or, having finished its work (leave_group), aborted in the group's teardown."""
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    init_file = os.fspath(tmp_path / "init")
    done_dir = Path(tempfile.mkdtemp(prefix="done", dir=tmp_path))  # (one per spawn: no stale record)
    os.environ[_DONE_DIR] = os.fspath(done_dir)  # (inherited by the spawned ranks)
    try:
        procs = [
            ctx.Process(target=target, args=(r, world, init_file, *args, failures)) for r in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        del os.environ[_DONE_DIR]
    for p in procs:
        p.join(timeout=timeout)
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, "\n".join(errors)
    for rank, p in enumerate(procs):
        if p.exitcode == -signal.SIGABRT and (done_dir / f"rank{rank}").exists():
            warnings.warn(
                f"rank {rank} finished its work, then aborted in the gloo group's teardown", stacklevel=2
            )
            continue
        assert p.exitcode == 0, [q.exitcode for q in procs]

"""Run a test body in several spawned processes, one per rank of a torch.distributed group (the ring
attention tests, on gloo and on NCCL)."""

from __future__ import annotations

import os

import torch.multiprocessing as mp


def spawn_ranks(target, world: int, tmp_path, *args, timeout: float = 120) -> None:
    """Run ``target(rank, world, init_file, *args, failures)`` in ``world`` spawned processes; fail with
    every rank's traceback if any of them raised (each puts its traceback in ``failures``)."""
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    init_file = os.fspath(tmp_path / "init")
    procs = [ctx.Process(target=target, args=(r, world, init_file, *args, failures)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

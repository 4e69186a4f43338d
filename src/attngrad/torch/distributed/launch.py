"""Run a function on `world` local processes joined in a gloo group on 127.0.0.1, and
collect what each returns: what the tests and `attngrad bench` use (a training script
would use torchrun instead). Every wait is bounded, and every process started is ended.
"""

from __future__ import annotations

import datetime
import os
import queue as queues
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, threads: int, timeout: float,
               results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):  # gloo's own traffic on the loopback too (macOS names it lo0)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


class RankFailed(RuntimeError):
    """A rank raised, or did not finish in time."""


def spawn(world: int, fn: Callable, *args: Any, threads: int = 1, timeout: float = 60.0,
          collective_timeout: float = 30.0, deaths: bool = False, wait_for: Optional[Sequence[int]] = None) -> list[Any]:
    """fn(rank, world, *args) on `world` new processes (fn importable, its results
    picklable), each with `threads` threads and a gloo group whose collectives give up
    after `collective_timeout` seconds. Returns the results in rank order; raises
    RankFailed with the first failing rank's traceback, or when `timeout` seconds pass.
    With `deaths`, a rank that dies is no failure: its result is None. With `wait_for`,
    only those ranks' results are awaited; the others' are None, and they are ended.
    A port taken between choosing it and binding it is chosen again (twice at most)."""
    for attempt in range(3):
        try:
            return _spawn_once(world, fn, args, threads, timeout, collective_timeout, deaths, wait_for)
        except RankFailed as failure:
            if attempt == 2 or "address already in use" not in str(failure).lower():
                raise
    raise AssertionError("unreachable")


def _spawn_once(world: int, fn: Callable, args: tuple, threads: int, timeout: float, collective_timeout: float,
                deaths: bool, wait_for: Optional[Sequence[int]]) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world, port, fn, args, threads, collective_timeout, results),
                                 daemon=True) for rank in range(world)]
    for p in processes:
        p.start()
    got: dict[int, Any] = {}
    awaited = set(range(world) if wait_for is None else wait_for)
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while not awaited <= set(got) and failure is None:
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queues.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in got]
                if deaths:
                    got.update((r, None) for r in dead)
                if time.monotonic() > deadline:
                    failure = f"ranks {sorted(awaited - set(got))} did not finish within {timeout} s"
                elif dead and not deaths and results.empty():
                    failure = f"ranks {dead} died (exit codes {[processes[r].exitcode for r in dead]})"
                continue
            if ok:
                got[rank] = value
            else:
                failure = f"rank {rank} raised:\n{value}"
    finally:
        for rank, p in enumerate(processes):
            p.join(timeout=5.0 if failure is None and rank in awaited else 0.1)
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    if failure is not None:
        raise RankFailed(failure)
    return [got.get(rank) for rank in range(world)]

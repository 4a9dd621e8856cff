"""The rank pool's parent side on the CPU, with stand-in ranks that speak its protocol through
the real ``_agree``: the parent relays every rank's value to every rank, sees a rank's death
as it happens (not after the example's timeout), and reports a rank's own error as its type."""
import multiprocessing
import os
import time

import pytest

from dispatcher.gpu.rank_pool import RankCrashed, RankPool, RemoteError

from .stand_in_rank import serve_one


@pytest.fixture
def stand_in_pool(tmp_path):
    made = []

    def make(*behaviours):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        pool = RankPool.__new__(RankPool)
        pool.ep_size, pool._logs, pool.timeout = len(behaviours), tmp_path, 30.0
        pipes = [ctx.Pipe() for _ in behaviours]
        pool._conns = [mine for mine, _ in pipes]
        pool._procs = [ctx.Process(target=serve_one, daemon=True,
                                   args=(theirs, r, os.getpid(), b))
                       for r, ((_, theirs), b) in enumerate(zip(pipes, behaviours))]
        for p in pool._procs:
            p.start()
        for _, theirs in pipes:
            theirs.close()
        for conn in pool._conns:
            conn.send(("rule", None, None, False))
        made.append(pool)
        return pool
    yield make
    for pool in made:
        pool.close(graceful=False)


def test_every_rank_gets_every_ranks_value(stand_in_pool):
    pool = stand_in_pool("ok", "ok", "ok")
    assert pool._collect(30, "example") == [[[], [1], [2, 2]]] * 3


def test_a_rank_that_dies_fails_the_example_at_once(stand_in_pool):
    pool = stand_in_pool("ok", "die")  # rank 0 waits for its value, forever
    t = time.monotonic()
    with pytest.raises(RankCrashed, match=r"rank process\(es\) \[1\] died"):
        pool._collect(30, "example")
    assert time.monotonic() - t < 10  # seen by its process sentinel, not the 30 s timeout


def test_ranks_that_received_different_worlds_refuse_together(stand_in_pool):
    pool = stand_in_pool("ok", "other world")
    with pytest.raises(RemoteError, match="different worlds"):
        pool._collect(30, "example")


def test_a_pool_left_mid_example_is_closed_without_asking(stand_in_pool, monkeypatch):
    """A Ctrl-C, or a watch's stop, while the ranks run an example: they may wait in a kernel
    or the agreement for a peer that will never come, deaf to their pipes. Closing the pool
    then kills them at once (asked to exit, each would use up its 10 s: a watch's next run
    waited for that)."""
    from dispatcher.model.world import World

    pool = stand_in_pool("deaf", "deaf")
    pool._in_flight, pool.max_dispatch_bytes = False, 1 << 30
    pool.max_combine_bytes = 1 << 30

    def interrupted(timeout, what):
        raise KeyboardInterrupt
    monkeypatch.setattr(pool, "_collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.run(World(ep_size=2, dp_size=1, group_tokens=(3,), max_num_tokens=8), "spec")
    t = time.monotonic()
    pool.close()
    assert time.monotonic() - t < 5 and not any(p.is_alive() for p in pool._procs)

"""A stand-in EP rank for ``test_rank_pool_protocol.py``: it speaks the pool's protocol through
the real ``rank_examples.agree`` and no more, in a spawned process that imports only this (no
pytest)."""
import os
import time

from dispatcher.gpu import rank_examples


def serve_one(conn, rank, parent, behaviour):
    state = {"conn": conn, "rank": rank, "parent": parent, "server": os.getppid()}
    conn.recv()  # the example
    if behaviour == "die":
        os._exit(3)
    if behaviour == "deaf":  # spins in its example (a kernel waiting for a peer): reads nothing
        time.sleep(300)
    try:
        values = rank_examples.agree(state, [rank] * rank, key=7 if behaviour != "other world" else 8)
        conn.send(("ok", rank, values))
    except RuntimeError as exc:
        conn.send(("error", rank, f"{type(exc).__name__}: {exc}"))

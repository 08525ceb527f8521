"""The serving side of the NIXL tests, run in a separate process (multiprocessing, spawn):
a NIXL agent that registers a block pool filled with a known pattern, publishes its
PeerInfo over a pipe, and reports the notifications it receives until told to exit.

The environment (UCX_MODULES, UCX_TLS) is inherited from the test that spawns it.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """The bytes the peer serves: distinct per block and per seed."""
    return ((np.arange(nbytes, dtype=np.uint64) * 7 + seed) % 251).astype(np.uint8)


def serve(conn: Connection, name: str, nbytes: int, seed: int) -> None:
    from vllm_kvtier.tiers.nixl.agent import NixlAgent

    pool = pattern(nbytes, seed)
    agent = NixlAgent(name)
    agent.register(pool)
    conn.send(agent.peer_info().to_dict())
    try:
        while True:
            notifs = agent.get_notifs()
            if notifs:
                conn.send(("notifs", notifs))
            if conn.poll(0.005) and conn.recv() == "exit":
                return
    finally:
        agent.close()

"""Worker side of P/D peer to peer over NIXL: the prefill instance lends its CPU tier, the
decode instance reads blocks straight out of it.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread (NIXL agents are created without thread synchronisation). ``read`` posts a
transfer and returns; results come back through ``poll``.

Both sides register two regions with their agent: the CPU pool (one allocation, every
plane) and a **stamp** array, 16 bytes per slot: the first 16 bytes of the key the slot
holds, written only once the slot's bytes are complete and zeroed before they change. A
decode-side read fetches the blocks *and* their stamps; a block is used only if its stamp
is the key it asked for. That covers a read that arrives before the prefill instance has
finished copying the block into the slot (its answer can reach the proxy first), and a
slot that was reused after its hold expired: either is a miss (recompute), never wrong KV.

What a prefill rank publishes (``describe``, carried to the scheduler in worker meta and
to the decode instance in ``kv_transfer_params``): NIXL agent metadata and regions, each
plane's base address and row size, the stamp array's address.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import numpy as np

from vllm_kvtier.config import NixlTierConfig
from vllm_kvtier.jobs import PeerRead
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.cpu import CPUPool

logger = logging.getLogger(__name__)

TIER = TierName.PEER
STAMP = 16


@dataclass
class PeerResult:
    read: PeerRead
    #: keys whose slot now holds them (stamp verified); the others failed
    good: set[bytes]


class PeerLink:
    def __init__(self, cfg: NixlTierConfig, pool: CPUPool, *, rank: int, counters: Counters) -> None:
        from vllm_kvtier.tiers.nixl_agent import NixlAgent

        self.pool = pool
        self.rank = rank
        self.counters = counters
        self.agent = NixlAgent(f"kvtier-{uuid.uuid4().hex[:12]}-r{rank}", cfg.store)
        self.stamps = np.zeros((pool.num_slots, STAMP), dtype=np.uint8)
        self.agent.register(pool.buffer)
        self.agent.register(self.stamps)
        self._plane_addrs = [int(p.data_ptr()) for p in pool.planes]
        self._stamp_addr = int(self.stamps.ctypes.data)
        self._reads: dict[int, PeerRead] = {}
        self._ids = 0
        self._peers: set[str] = set()

    # ---- both sides: stamps -------------------------------------------------------------

    def stamp(self, slot: int, key: bytes | None) -> None:
        """``slot`` now holds ``key`` completely (None: its bytes are about to change)."""
        row = self.stamps[slot]
        if key is None:
            row[:] = 0
        else:
            row[:] = np.frombuffer(key[:STAMP].ljust(STAMP, b"\0"), dtype=np.uint8)

    # ---- prefill side -------------------------------------------------------------------

    def describe(self) -> dict:
        """How a decode instance reads this rank's CPU tier (JSON-safe)."""
        return {
            "agent": self.agent.peer_info().to_dict(),
            "planes": [[a, int(pb)] for a, pb in zip(self._plane_addrs, self.pool.plane_bytes, strict=True)],
            "stamps": self._stamp_addr,
        }

    def done_requests(self) -> set[str]:
        """Requests whose blocks a decode instance finished reading (NIXL notifications)."""
        out: set[str] = set()
        for msgs in self.agent.get_notifs().values():
            for m in msgs:
                try:
                    out.add(m.decode())
                except UnicodeDecodeError:
                    continue
        return out

    # ---- decode side --------------------------------------------------------------------

    def read(self, read: PeerRead) -> int | None:
        """Post the read of ``read``'s blocks and stamps; its id, or None if the peer's
        description is unusable here (a miss) or there is nothing to read (then the prefill
        side is only told that it may free the offer)."""
        from vllm_kvtier.tiers.nixl_agent import PeerInfo

        try:
            desc = read.peer["ranks"][str(self.rank)]
            info = PeerInfo.from_dict(desc["agent"])
            planes = [(int(a), int(pb)) for a, pb in desc["planes"]]
            stamps = int(desc["stamps"])
            if [pb for _, pb in planes] != list(self.pool.plane_bytes):
                raise ValueError(f"plane sizes {[pb for _, pb in planes]} != ours {list(self.pool.plane_bytes)}")
            if info.name not in self._peers:
                self.agent.add_peer(info)
                self._peers.add(info.name)
        except Exception as e:  # a malformed offer, or a peer that is gone (NIXL cannot connect)
            logger.warning("kvtier peer: cannot read from the prefill instance of %s: %s", read.req_id, e)
            self.counters.add("load_failures", TIER, len(read.keys))
            return None
        notif = (read.notify or read.req_id).encode()
        if not read.slots:  # every offered block was in our DRAM already: just free them there
            self.agent.notify(info.name, notif)
            return None
        spans = []
        for rs, ls in zip(read.remote_slots, read.slots, strict=True):
            self.stamp(ls, None)
            for (raddr, pb), laddr in zip(planes, self._plane_addrs, strict=True):
                spans.append((laddr + ls * pb, raddr + rs * pb, pb))
            spans.append((self._stamp_addr + ls * STAMP, stamps + rs * STAMP, STAMP))
        self._ids += 1
        self._reads[self._ids] = read
        self.agent.submit_read(self._ids, info.name, spans, notif=notif)
        return self._ids

    def poll(self) -> list[tuple[int, PeerResult]]:
        out = []
        for res in self.agent.poll():
            read = self._reads.pop(res.job_id, None)
            if read is None:
                continue
            good: set[bytes] = set()
            if res.ok:
                for ls, key in zip(read.slots, read.keys, strict=True):
                    if bytes(self.stamps[ls]) == key[:STAMP].ljust(STAMP, b"\0"):
                        good.add(key)
                    else:
                        self.stamp(ls, None)
                self.counters.add("blocks_loaded", TIER, len(good))
                self.counters.add("bytes_loaded", TIER, len(good) * self.pool.slot_bytes)
                self.counters.add("load_seconds", TIER, res.seconds)
            bad = len(read.keys) - len(good)
            if bad:
                logger.warning("kvtier peer: %d of %d blocks of %s not read from the prefill instance (%s)",
                               bad, len(read.keys), read.req_id, res.reason or "not ready or reused")
                self.counters.add("load_failures", TIER, bad)
            out.append((res.job_id, PeerResult(read, good)))
        return out

    def pending(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        self.agent.close()

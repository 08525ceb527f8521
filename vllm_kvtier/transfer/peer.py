"""Worker side of P/D peer to peer over NIXL.

The prefill instance lends its CPU tier. The decode instance reads blocks straight out of
it.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread (NIXL agents are created without thread synchronisation). ``read`` posts a
transfer and returns; results come back through ``poll``.

Both sides register two regions with their agent. One is the CPU pool (one allocation,
every plane). The other is a **stamp** array, 16 bytes per slot. A stamp is the first 16
bytes of the key the slot holds. It is written only once the slot's bytes are complete. It
is zeroed before they change: :class:`~vllm_kvtier.transfer.slots.SlotTable` clears a
slot's stamp before any copy into it starts. A decode-side read is a seqlock in three NIXL
transfers. Each is posted once the one before completed, since the spans of one transfer
land in no guaranteed order. First the stamps. Then the blocks whose stamp was the key
asked for. Then the stamps again, with the notification that frees the offer. A block is
used only if both stamps are its key. Then the slot held it completely before the bytes
were read, and was not rewritten (its stamp cleared) until after. This covers three
cases, each a miss (recompute), never torn or wrong KV. A read may arrive before the
prefill instance has finished copying the block into the slot (its answer can reach the
proxy first). A slot may be reused after its hold expired. A slot may be rewritten while
it is being read.

What a prefill rank publishes (``describe``): NIXL agent metadata and regions, each
plane's base address and row size, the stamp array's address. It is carried to the
scheduler in worker meta and to the decode instance in ``kv_transfer_params``. Its agent
is named ``<nixl.agent_name>-<random>-r<rank>``.

Peers (decode side): a description reaches us through a request's ``kv_transfer_params``,
which a client can write. So an agent not allowed by ``nixl.allowed_peers`` /
``trusted_peers`` is never added. The scheduler refused it already. This is the second
check, on the name NIXL itself reads from the metadata. At most ``nixl.max_peers`` remote
agents stay connected. A peer idle (no read in flight) for ``nixl.hold_s`` is removed (its
offers have expired by then). So is the least recently used idle one, when a new one
would exceed the cap. If every one has a read in flight, the new read is refused
(recomputed, ``peer_refusals``). Removals are counted in ``peers_removed``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm_kvtier.config import NixlTierConfig
from vllm_kvtier.jobs import PeerRead
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.tiers.cpu import CPUPool

if TYPE_CHECKING:
    from vllm_kvtier.tiers.nixl.agent import NixlAgent, PeerInfo

logger = logging.getLogger(__name__)

TIER = TierName.PEER
STAMP = 16


class _Refused(Exception):
    """A read this worker does not post (an agent not allowed, or no room for a peer)."""


@dataclass
class _Seq:
    """One peer read between its transfers: ``phase`` "pre" (the stamps), "data" (the
    blocks whose stamp was right), "post" (the stamps again)."""

    read: PeerRead
    peer: str
    planes: list[tuple[int, int]]
    stamps: int
    notif: bytes
    phase: str = "pre"
    #: local slots whose first stamp was the key asked for
    pre_ok: set[int] | None = None
    seconds: float = 0.0
    #: the read's id (each phase is a transfer of its own)
    rid: int = 0


@dataclass
class PeerResult:
    read: PeerRead
    #: keys whose slot now holds them (stamp verified); the others failed
    good: set[bytes]


class PeerTable:
    """The remote agents a decode rank reads from, and the reads in flight from each.

    At most ``nixl.max_peers`` stay added. One idle for ``nixl.hold_s`` is removed, and so
    is the least recently used idle one when a new one needs room. Who calls it: its
    :class:`PeerLink`, on the worker's main thread."""

    def __init__(self, cfg: NixlTierConfig, agent: NixlAgent, counters: Counters,
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.agent = agent
        self.counters = counters
        self._clock = clock
        #: remote agents added, least recently used first -> when their last read ended
        self._peers: OrderedDict[str, float] = OrderedDict()
        #: remote agent -> reads in flight from it
        self._busy: dict[str, int] = {}

    def connect(self, info: PeerInfo) -> bool:
        """Have ``info``'s agent added (it may already be); False if that would exceed
        ``nixl.max_peers`` with every peer busy. Raises what NIXL raises on bad metadata."""
        name = info.name
        if name in self._peers:
            self._peers[name] = self._clock()
            self._peers.move_to_end(name)
            return True
        self.expire()
        if len(self._peers) >= self.cfg.max_peers:
            idle = next((n for n in self._peers if not self._busy.get(n)), None)
            if idle is None:
                return False
            self._remove(idle)
        self.agent.add_peer(info)
        self._peers[name] = self._clock()
        return True

    def read_started(self, name: str) -> None:
        self._busy[name] = self._busy.get(name, 0) + 1

    def read_ended(self, name: str) -> None:
        """A read from ``name`` ended: it is the most recently used peer now."""
        if name in self._peers:
            self._busy[name] = self._busy.get(name, 1) - 1
            self._peers[name] = self._clock()
            self._peers.move_to_end(name)

    def _remove(self, name: str) -> None:
        self._peers.pop(name, None)
        self._busy.pop(name, None)
        self.agent.remove_peer(name)
        self.counters.add(CounterName.PEERS_REMOVED, TIER)

    def expire(self) -> list[str]:
        """Remove peers with no read in flight whose last read ended ``nixl.hold_s`` ago;
        the names removed."""
        due = self._clock() - self.cfg.hold_s
        gone = [n for n, t in self._peers.items() if t <= due and not self._busy.get(n)]
        for name in gone:
            self._remove(name)
        return gone

    def names(self) -> list[str]:
        """Remote agents connected now, least recently used first."""
        return list(self._peers)


class PeerLink:
    def __init__(self, cfg: NixlTierConfig, pool: CPUPool, *, rank: int, counters: Counters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: monotonic seconds, for peers' idle times (tests pass their own)."""
        from vllm_kvtier.tiers.nixl.agent import NixlAgent

        self.cfg = cfg
        self.pool = pool
        self.rank = rank
        self.counters = counters
        self.agent = NixlAgent(f"{cfg.agent_name}-{uuid.uuid4().hex[:12]}-r{rank}", cfg.store)
        self._table = PeerTable(cfg, self.agent, counters, clock)
        self.stamps = np.zeros((pool.num_slots, STAMP), dtype=np.uint8)
        self.agent.register(pool.buffer)
        self.agent.register(self.stamps)
        self._plane_addrs = [int(p.data_ptr()) for p in pool.planes]
        self._stamp_addr = int(self.stamps.ctypes.data)
        #: transfer id -> the read it is a phase of
        self._reads: dict[int, _Seq] = {}
        self._ids = 0

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
        from vllm_kvtier.tiers.nixl.agent import PeerInfo

        try:
            desc = read.peer["ranks"][str(self.rank)]
            info = PeerInfo.from_dict(desc["agent"])
            planes = [(int(a), int(pb)) for a, pb in desc["planes"]]
            stamps = int(desc["stamps"])
            if [pb for _, pb in planes] != list(self.pool.plane_bytes):
                raise ValueError(f"plane sizes {[pb for _, pb in planes]} != ours {list(self.pool.plane_bytes)}")
            if not self.cfg.allows_peer(info.name):
                raise _Refused(f"agent {info.name!r} is not in nixl.allowed_peers")
            if not self._table.connect(info):
                raise _Refused(f"nixl.max_peers = {self.cfg.max_peers} peers all have reads in flight")
        except Exception as e:  # a malformed offer, or a peer that is gone (NIXL cannot connect)
            logger.warning("kvtier peer: cannot read from the prefill instance of %s: %s", read.req_id, e)
            if isinstance(e, _Refused):
                self.counters.add(CounterName.PEER_REFUSALS, TIER)
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(read.keys))
            return None
        notif = (read.notify or read.req_id).encode()
        if not read.slots:  # every offered block was in our DRAM already: just free them there
            self.agent.notify(info.name, notif)
            return None
        for ls in read.slots:
            self.stamp(ls, None)
        self._ids += 1
        seq = _Seq(read, info.name, planes, stamps, notif, rid=self._ids)
        self._table.read_started(info.name)
        self._post(seq, "pre")
        return seq.rid

    def _stamp_spans(self, seq: _Seq) -> list[tuple[int, int, int]]:
        return [(self._stamp_addr + ls * STAMP, seq.stamps + rs * STAMP, STAMP)
                for rs, ls in zip(seq.read.remote_slots, seq.read.slots, strict=True)]

    def _post(self, seq: _Seq, phase: str) -> None:
        """Post ``phase`` of read ``seq`` (a transfer id of its own, mapped to ``seq``)."""
        seq.phase = phase
        if phase == "data":
            assert seq.pre_ok is not None
            spans = [(laddr + ls * pb, raddr + rs * pb, pb)
                     for rs, ls in zip(seq.read.remote_slots, seq.read.slots, strict=True) if ls in seq.pre_ok
                     for (raddr, pb), laddr in zip(seq.planes, self._plane_addrs, strict=True)]
        else:
            spans = self._stamp_spans(seq)
        self._ids += 1
        self._reads[self._ids] = seq
        self.agent.submit_read(self._ids, seq.peer, spans, notif=seq.notif if phase == "post" else b"")

    def _matches(self, slot: int, key: bytes) -> bool:
        return bytes(self.stamps[slot]) == key[:STAMP].ljust(STAMP, b"\0")

    def expire_peers(self) -> list[str]:
        """Remove peers with no read in flight whose last read ended ``nixl.hold_s`` ago
        (each worker step); the names removed."""
        return self._table.expire()

    def peers(self) -> list[str]:
        """Remote agents connected now, least recently used first."""
        return self._table.names()

    def poll(self) -> list[tuple[int, PeerResult]]:
        out = []
        for res in self.agent.poll():
            seq = self._reads.pop(res.job_id, None)
            if seq is None:
                continue
            rid = seq.rid
            read = seq.read
            seq.seconds += res.seconds
            if res.ok and seq.phase == "pre":
                seq.pre_ok = {ls for ls, key in zip(read.slots, read.keys, strict=True) if self._matches(ls, key)}
                for ls in read.slots:
                    self.stamp(ls, None)  # the second stamp lands here
                if seq.pre_ok:
                    self._post(seq, "data")
                    continue
                self.agent.notify(seq.peer, seq.notif)  # nothing complete to read: free the offer
            elif res.ok and seq.phase == "data":
                self._post(seq, "post")
                continue
            self._table.read_ended(seq.peer)
            good: set[bytes] = set()
            if res.ok:
                for ls, key in zip(read.slots, read.keys, strict=True):
                    if seq.phase == "post" and seq.pre_ok is not None and ls in seq.pre_ok and self._matches(ls, key):
                        good.add(key)
                    else:
                        self.stamp(ls, None)
                self.counters.add(CounterName.BLOCKS_LOADED, TIER, len(good))
                self.counters.add(CounterName.BYTES_LOADED, TIER, len(good) * self.pool.slot_bytes)
                self.counters.add(CounterName.LOAD_SECONDS, TIER, seq.seconds)
            else:
                for ls in read.slots:
                    self.stamp(ls, None)
            bad = len(read.keys) - len(good)
            if bad:
                logger.warning("kvtier peer: %d of %d blocks of %s not read from the prefill instance (%s)",
                               bad, len(read.keys), read.req_id, res.reason or "not ready or reused")
                self.counters.add(CounterName.LOAD_FAILURES, TIER, bad)
            out.append((rid, PeerResult(read, good)))
        self.expire_peers()
        return out

    def pending(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        self.agent.close()

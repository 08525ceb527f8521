"""The store kernel's queue items (tiers/kernel/jobs.py): ordered by priority, then by
submission; the payload never takes part in the order."""

from __future__ import annotations

import queue

from vllm_kvtier.tiers.kernel.jobs import Op, QueueItem, ReadJob


def test_reads_come_before_writes_and_deletes_and_the_stop_last() -> None:
    q: queue.PriorityQueue[QueueItem] = queue.PriorityQueue()
    ops = [Op.STOP, Op.DELETE, Op.WRITE, Op.PART, Op.PROBE, Op.WRITE]
    for seq, op in enumerate(ops):
        q.put(QueueItem(op.priority, seq, op, chunk_id=f"c{seq}"))
    got = [q.get() for _ in ops]
    assert [i.op for i in got] == [Op.PART, Op.PROBE, Op.WRITE, Op.WRITE, Op.DELETE, Op.STOP]
    assert [i.seq for i in got] == [3, 4, 2, 5, 1, 0]  # submission order within a priority


def test_the_payload_is_not_compared() -> None:
    job = ReadJob(1, "c", None, [0], [b"k"], 0.0, 0.0)  # eq=False: not orderable itself
    a = QueueItem(Op.PROBE.priority, 1, Op.PROBE, read=job)
    b = QueueItem(Op.PROBE.priority, 1, Op.PROBE, read=ReadJob(2, "d", None, [0], [b"k"], 0.0, 0.0))
    assert not a < b and not b < a

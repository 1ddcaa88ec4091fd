"""stats() counts what the metrics hooks are told, and the user's sink is told the same events."""

import asyncio
from collections import Counter

import pytest

from batching import AdaptiveBatcher, BatcherConfig, BatcherMetrics, DeadlineExceeded, Overloaded

from .fake_process import FakeProcess

pytestmark = pytest.mark.looptime


class Recording(BatcherMetrics):
    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self.depths: list[int] = []
        self.latencies = 0

    def items_admitted(self, batcher, count):
        self.totals["items"] += count

    def queue_depth(self, batcher, priority, depth):
        self.depths.append(depth)

    def batch_flushed(self, batcher, reason, size, waits_s):
        self.totals["batches"] += 1
        self.totals["dispatched_items"] += size
        self.totals[f"flush:{reason}"] += 1

    def batch_completed(self, batcher, latency_s):
        self.latencies += 1

    def item_rejected(self, batcher, reason, count):
        self.totals[reason] += count

    def item_retried(self, batcher, count):
        self.totals["retried"] += count

    def batch_split(self, batcher):
        self.totals["splits"] += 1


async def test_stats_are_the_totals_the_users_sink_hears():
    failures = {"flaky": 1}

    def answer(p):
        if p == "poison":
            return None
        if failures.get(p):
            failures[p] -= 1
            return ConnectionError("reset")
        return p

    async def process(payloads):
        if "poison" in payloads:
            raise ValueError("poisonous batch")
        return [answer(p) for p in payloads]

    sink = Recording()
    config = BatcherConfig(max_batch_size=4, max_concurrent_batches=1, max_queue_depth=6, max_wait_ms=0,
                           max_retries=1, stall_factor=None)
    batcher = AdaptiveBatcher(process, config, metrics=sink, name="m")
    results = await batcher.submit_many(["a", "flaky", "poison", "b"], return_exceptions=True)
    assert results[:2] == ["a", "flaky"] and isinstance(results[2], ValueError) and results[3] == "b"

    slow = FakeProcess(delay_s=1.0)
    busy = AdaptiveBatcher(slow, config, metrics=sink, name="m")
    first = asyncio.ensure_future(busy.submit("first"))
    await slow.started.wait()
    gone = asyncio.ensure_future(busy.submit("gone"))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(DeadlineExceeded):
        await busy.submit("late", timeout_s=0.1)
    queued = asyncio.ensure_future(busy.submit_many(list(range(5))))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await busy.submit_many([5, 6])
    await asyncio.gather(first, queued)

    stats = [batcher.stats(), busy.stats()]
    heard = sink.totals
    assert sum(s.items for s in stats) == heard["items"] == 4 + 1 + 1 + 1 + 5
    assert sum(s.batches for s in stats) == heard["batches"]
    assert sum(s.dispatched_items for s in stats) == heard["dispatched_items"]
    assert sum((Counter(s.flushes) for s in stats), Counter()) == {
        key.removeprefix("flush:"): count for key, count in heard.items() if key.startswith("flush:")}
    assert [s.rejected for s in stats] == [0, heard["overload"]] == [0, 2]
    assert [s.expired for s in stats] == [0, heard["deadline"]] == [0, 1]
    assert [s.cancelled for s in stats] == [0, heard["cancelled"]] == [0, 1]
    assert [s.retried for s in stats] == [heard["retried"], 0] == [1, 0]
    assert [s.splits for s in stats] == [heard["splits"], 0] == [2, 0]
    assert sink.depths and sink.latencies  # the hooks nothing counts still reach the sink

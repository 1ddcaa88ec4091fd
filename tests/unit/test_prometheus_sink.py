import asyncio

import pytest
from prometheus_client import CollectorRegistry

from batching import AdaptiveBatcher, BatcherConfig, Overloaded, Priority
from batching.prometheus import PrometheusMetrics

from .fake_process import FakeProcess

pytestmark = pytest.mark.looptime


async def test_prometheus_sink_records_the_standard_metrics():
    registry = CollectorRegistry()
    config = BatcherConfig(max_batch_size=4, max_queue_depth=4, max_wait_ms=10, stall_factor=None)
    batcher = AdaptiveBatcher(FakeProcess(delay_s=0.01), config, metrics=PrometheusMetrics(registry), name="m")
    await asyncio.gather(*(batcher.submit(i) for i in range(6)))
    waiting = [asyncio.ensure_future(batcher.submit(i)) for i in range(10, 13)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await batcher.submit("refused", priority=Priority.LOW)
    await asyncio.gather(*waiting)

    def value(name, **labels):
        return registry.get_sample_value(name, {"batcher": "m", **labels})

    assert value("batcher_flush_total", reason="size") == 1
    assert value("batcher_flush_total", reason="time") == 2
    assert value("batcher_batch_size_count") == 3 and value("batcher_batch_size_sum") == 9
    assert value("batcher_item_wait_ms_count") == 9
    assert value("batcher_rejected_total", reason="overload") == 1
    assert value("batcher_queue_depth", priority="high") == 0
    assert value("batcher_batch_latency_ms_count") == 3
    assert value("batcher_batch_size_bucket", le="1.0") == 0
    assert value("batcher_batch_size_bucket", le="5.0") == 3

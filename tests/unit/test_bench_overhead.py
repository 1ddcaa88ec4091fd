"""The overhead benchmark runs end to end, and the article's batcher baseline behaves as its docstring says."""

import asyncio
import json

import pytest

from load.article_batcher import ArticleBatcher
from load.bench.__main__ import build_parser

from .fake_process import FakeProcess


def test_quick_overhead_run_writes_results_and_every_contender_processes_every_item(tmp_path):
    args = build_parser().parse_args(["overhead", "--quick", "--results-dir", str(tmp_path)])
    returned = args.run(args)

    written = json.loads((tmp_path / "overhead.json").read_text())
    assert "overhead.json" in {p.name for p in tmp_path.iterdir()} and (tmp_path / "overhead.md").read_text()
    assert written["machine"]["cpu_count"] >= 1
    assert written["per_item"]["target_ratio"] == 0.5
    assert returned["per_item"]["contenders"].keys() == {"adaptive", "batching.batch", "serve.batch", "article"}
    assert written["streaming"]["contenders"].keys() == {"batching.batch", "serve.batch"}
    assert all(row["per_item_us"] > 0 and row["per_step_us"] > 0 for row in written["streaming"]["contenders"].values())
    for name, contender in written["per_item"]["contenders"].items():
        assert contender["items_processed"] == contender["items_submitted"] > 0, name
        assert contender["batches_per_round"] >= 1, name
    assert written["submission_stall"].keys() == {"adaptive", "article"}
    for name, contender in written["submission_stall"].items():
        assert contender["items_processed"] == contender["items_submitted"] > 0, name


@pytest.mark.looptime
async def test_article_batcher_returns_results_in_input_order():
    process = FakeProcess()
    batcher = ArticleBatcher(process, max_batch_size=10, max_wait_ms=5)
    results = await asyncio.gather(*(batcher.add(i) for i in range(25)))
    assert results == [("ok", i) for i in range(25)]
    assert [len(call) for call in process.calls] == [10, 10, 5]
    assert batcher.get_stats()["total_batches"] == 3


@pytest.mark.looptime
async def test_article_batcher_raised_error_fails_the_whole_batch():
    async def explode_on_bad(payloads):
        if "bad" in payloads:
            raise ValueError("poisoned batch")
        return payloads

    batcher = ArticleBatcher(explode_on_bad, max_batch_size=3, max_wait_ms=5)
    poisoned = await asyncio.gather(*(batcher.add(p) for p in ["a", "bad", "c"]), return_exceptions=True)
    assert all(isinstance(outcome, ValueError) for outcome in poisoned)
    assert await batcher.add("fine") == "fine"


@pytest.mark.looptime
async def test_article_batcher_wait_is_fixed_by_depth_when_the_timer_starts():
    process = FakeProcess()
    batcher = ArticleBatcher(process, max_batch_size=100, max_wait_ms=100, scale_factor=1)
    start = asyncio.get_running_loop().time()
    first = asyncio.ensure_future(batcher.add("a"))
    await asyncio.sleep(0.01)  # the timer started at depth 1: 50 ms; at depth 6 it would be 83 ms
    rest = [asyncio.ensure_future(batcher.add(x)) for x in "bcdef"]
    await asyncio.gather(first, *rest)
    assert process.started_at[0] - start == pytest.approx(0.05, abs=1e-3)
    assert process.calls == [list("abcdef")]


@pytest.mark.looptime
async def test_article_batcher_stalls_submissions_behind_a_time_triggered_batch():
    process = FakeProcess(delay_s=0.1)
    batcher = ArticleBatcher(process, max_batch_size=100, max_wait_ms=5)
    first = asyncio.ensure_future(batcher.add("first"))
    await process.started.wait()
    second = asyncio.ensure_future(batcher.add("second"))
    await asyncio.sleep(0.05)
    assert batcher.get_stats()["total_items"] == 1  # "second" waits on the lock the batch in flight holds
    await first
    await asyncio.sleep(0)
    assert batcher.get_stats()["total_items"] == 2
    assert await second == ("ok", "second")

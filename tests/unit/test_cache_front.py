"""The cache in front of the batcher: hits, misses, single flight, failures and a failing store, on looptime's
clock (no real time passes; every wait is exact)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from batching import DeadlineExceeded, Overloaded, Priority

from .cache_fakes import (TIMEOUT_S, FakeModel, MemoryStore, RecordingMetrics, embed, held_model, make_cache, settle,
                          started, vector)

pytestmark = pytest.mark.looptime


async def test_a_miss_is_computed_and_written_back_and_then_is_a_hit_that_never_reaches_the_model() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)
    first = await embed(cache, "alpha", "beta")
    await settle()
    second = await embed(cache, "beta", "alpha")
    assert model.calls == [["alpha", "beta"]]
    assert second[0].tobytes() == first[1].tobytes() == vector("beta").tobytes()
    assert second[1].tobytes() == vector("alpha").tobytes()
    assert metrics.lookups == {"miss": 2, "hit": 2}
    assert metrics.saved_inputs == 2 and metrics.saved_tokens == len("alpha") + len("beta")
    assert metrics.bytes == {"written": 2 * 4 * 8, "read": 2 * 4 * 8}


async def test_a_text_sent_twice_in_one_request_is_computed_once() -> None:
    model = FakeModel()
    outcomes = await embed(make_cache(model=model), "same", "other", "same")
    assert model.calls == [["same", "other"]]
    assert outcomes[0].tobytes() == outcomes[2].tobytes()


async def test_concurrent_requests_for_a_missing_text_share_one_computation() -> None:
    metrics, model = RecordingMetrics(), held_model()
    cache = make_cache(metrics=metrics, model=model)
    first = await started(embed(cache, "shared"))
    second = await started(embed(cache, "shared", "own"))  # rides in another batch
    model.gate.set()
    (a,), (b, own) = await first, await second
    assert model.calls == [["shared"], ["own"]]
    assert a.tobytes() == b.tobytes() == vector("shared").tobytes()
    assert own.tobytes() == vector("own").tobytes()
    assert metrics.lookups["joined"] == 1 and metrics.lookups["miss"] == 2


async def test_a_request_arriving_while_the_vector_is_written_back_joins_instead_of_computing() -> None:
    store, model = MemoryStore(), FakeModel()
    store.delay_s = TIMEOUT_S / 2
    cache = make_cache(store, model=model)
    await embed(cache, "slow write")
    (again,) = await embed(cache, "slow write")  # its write has not landed yet
    assert model.calls == [["slow write"]]
    assert again.tobytes() == vector("slow write").tobytes()


async def test_high_never_joins_a_low_computation() -> None:
    model = held_model()
    cache = make_cache(model=model)
    low = await started(embed(cache, "text", priority=Priority.LOW))
    high = await started(embed(cache, "text", priority=Priority.HIGH))
    later_low = await started(embed(cache, "text", priority=Priority.LOW))
    model.gate.set()
    await asyncio.gather(low, high, later_low)
    assert model.calls == [["text"], ["text"]]  # LOW's, then HIGH's own; the later LOW joined one of them


async def test_a_joiner_outlives_its_leaders_deadline_and_computes_the_text_itself() -> None:
    model = held_model()
    cache = make_cache(model=model)
    leader = await started(embed(cache, "text", timeout_s=0.1))
    joiner = asyncio.ensure_future(embed(cache, "text"))
    await asyncio.sleep(0.2)  # the leader's deadline passed
    (late,) = await leader
    assert isinstance(late, DeadlineExceeded)
    model.gate.set()
    (vector_,) = await joiner
    assert vector_.tobytes() == vector("text").tobytes()
    assert model.calls == [["text"], ["text"]]


async def test_a_joiner_times_out_on_its_own_deadline() -> None:
    model = held_model()
    cache = make_cache(model=model)
    leader = await started(embed(cache, "text"))
    (late,) = await embed(cache, "text", timeout_s=0.1)
    assert isinstance(late, DeadlineExceeded)
    model.gate.set()
    assert (await leader)[0].tobytes() == vector("text").tobytes()


async def test_a_cancelled_leader_leaves_its_joiners_to_compute_the_text() -> None:
    model = held_model()
    cache = make_cache(model=model)
    leader = await started(embed(cache, "text"))
    joiner = await started(embed(cache, "text"))
    leader.cancel()
    await asyncio.sleep(0.01)
    model.gate.set()
    (vector_,) = await joiner
    assert vector_.tobytes() == vector("text").tobytes()
    assert len(model.calls) == 2


async def test_a_refused_leader_raises_and_its_joiners_try_themselves() -> None:
    model = held_model()
    cache = make_cache(model=model)
    model.refuse_next = Overloaded(1.0)  # what the batcher raises for a request it cannot queue
    leader = await started(embed(cache, "text"))
    joiner = await started(embed(cache, "text"))
    model.gate.set()
    with pytest.raises(Overloaded):
        await leader
    (vector_,) = await joiner
    assert vector_.tobytes() == vector("text").tobytes()
    assert model.calls == [["text"], ["text"]]  # the leader's, refused; the joiner's own


async def test_a_request_the_batcher_refuses_raises_and_leaves_nothing_in_flight() -> None:
    model = FakeModel()
    cache = make_cache(model=model)
    model.refuse = Overloaded(2.0)
    with pytest.raises(Overloaded):
        await embed(cache, "text")
    model.refuse = None
    (vector_,) = await embed(cache, "text")
    assert vector_.tobytes() == vector("text").tobytes()


async def test_failures_are_shared_with_joiners_but_never_stored() -> None:
    store, model = MemoryStore(), held_model()
    cache = make_cache(store, model=model)
    model.failing = {"poison"}
    first = await started(embed(cache, "poison"))
    second = await started(embed(cache, "poison"))
    model.gate.set()
    (a,), (b,) = await first, await second
    assert isinstance(a, ValueError) and b is a
    await settle()
    assert store.data == {}
    await embed(cache, "poison")
    assert len(model.calls) == 2


async def test_a_store_that_is_down_costs_a_miss_is_counted_and_is_skipped_for_a_moment() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)
    store.down = True
    (first,) = await embed(cache, "text")
    (second,) = await embed(cache, "other")
    assert first.tobytes() == vector("text").tobytes() and second.tobytes() == vector("other").tobytes()
    assert metrics.store_errors[("get", "error")] == 1 and metrics.store_errors[("get", "skipped")] == 1
    assert store.calls["get"] == 1  # the second request did not wait for the store
    await settle()  # past the cool-down
    store.down = False
    await embed(cache, "text")
    await settle()
    (again,) = await embed(cache, "text")
    assert again.tobytes() == first.tobytes() and len(model.calls) == 3


async def test_a_slow_store_costs_at_most_its_timeout() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)
    store.delay_s = 10.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    (vector_,) = await embed(cache, "text")
    assert loop.time() - started == pytest.approx(TIMEOUT_S)
    assert vector_.tobytes() == vector("text").tobytes()
    assert metrics.store_errors[("get", "timeout")] == 1


async def test_a_low_request_waits_longer_for_the_store_than_a_high_one() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, patient_timeout_s=0.5, model=model)
    await embed(cache, "text")
    await settle()
    store.delay_s = 0.2  # past the store's 50 ms, within a LOW lookup's 500 ms
    loop = asyncio.get_running_loop()
    started = loop.time()
    (found,) = await embed(cache, "text", priority=Priority.LOW)
    assert loop.time() - started == pytest.approx(0.2)
    (computed,) = await embed(cache, "text")  # HIGH: a miss after 50 ms, computed again
    assert found.tobytes() == computed.tobytes() == vector("text").tobytes()
    assert model.calls == [["text"], ["text"]] and metrics.store_errors == {("get", "timeout"): 1}


async def test_a_read_answered_late_while_the_store_answers_others_does_not_keep_requests_off_it() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)
    await embed(cache, "text", "other")
    await settle()
    store.delay_s = 10.0
    late = await started(embed(cache, "text"))
    store.delay_s = 0.0
    (answered,) = await embed(cache, "other")  # sent after the late read, answered before its timeout
    (computed,) = await late
    (found,) = await embed(cache, "other")  # right after the late read: the store is still asked
    assert metrics.store_errors == {("get", "timeout"): 1}  # nothing skipped
    assert store.calls["get"] == 4 and model.calls == [["text", "other"], ["text"]]  # the late read's input alone
    assert computed.tobytes() == vector("text").tobytes()
    assert found.tobytes() == answered.tobytes() == vector("other").tobytes()


async def test_a_stored_value_that_is_not_a_float32_vector_is_a_miss() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)
    await embed(cache, "text")
    await settle()
    (key,) = store.data
    store.data[key] = b"\x00\x01\x02"
    (vector_,) = await embed(cache, "text")
    assert vector_.tobytes() == vector("text").tobytes()
    assert len(model.calls) == 2 and metrics.store_errors[("get", "corrupt")] == 1


async def test_another_model_or_output_size_never_finds_the_vector() -> None:
    store, model = MemoryStore(), FakeModel()
    await embed(make_cache(store, identity="model v1", model=model), "text")
    await settle()
    newer = make_cache(store, identity="model v2", model=model)
    await embed(newer, "text")
    await embed(make_cache(store, identity="model v1", model=model), "text", dimensions=4)
    await embed(make_cache(store, identity="model v1", name="another entry", model=model), "text")
    assert len(model.calls) == 4
    await settle()
    await embed(newer, "text")
    assert len(model.calls) == 4


async def test_text_and_token_ids_are_different_inputs() -> None:
    model = FakeModel()
    cache = make_cache(model=model)
    text, ids = await embed(cache, "12", (1, 2))
    await settle()
    again_ids, again_text = await embed(cache, (1, 2), "12")
    assert model.calls == [["12", (1, 2)]]
    assert again_ids.tobytes() == ids.tobytes() and again_text.tobytes() == text.tobytes()
    assert not np.array_equal(text, ids)


async def test_close_lets_the_writes_in_progress_land() -> None:
    store, model = MemoryStore(), FakeModel()
    store.delay_s = TIMEOUT_S / 2
    cache = make_cache(store, model=model)
    await embed(cache, "text")
    await cache.aclose()
    assert len(store.data) == 1


async def test_written_returns_once_every_write_back_landed_also_those_started_meanwhile() -> None:
    store, model = MemoryStore(), FakeModel()
    store.delay_s = 0.020
    cache = make_cache(store, model=model)
    await embed(cache, "first")  # t=20 ms; its write lands at 40
    waiting = asyncio.ensure_future(cache.written())
    store.delay_s = 0.015
    await embed(cache, "second")  # t=35; its write, started while the first one's is awaited, lands at 50
    await waiting
    assert len(store.data) == 2


async def test_a_write_slower_than_a_read_may_be_still_lands() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)
    store.delay_s = TIMEOUT_S * 10
    await embed(cache, "text")  # its read times out: a miss, computed
    await asyncio.sleep(TIMEOUT_S * 20)  # the write, slower than a read may be, lands
    assert len(store.data) == 1 and metrics.store_errors[("get", "timeout")] == 1
    assert not [op for op, _ in metrics.store_errors if op == "set"]


async def test_a_failed_write_is_counted_and_keeps_no_request_off_the_store() -> None:
    store, metrics, model = MemoryStore(), RecordingMetrics(), FakeModel()
    cache = make_cache(store, metrics, model=model)

    async def refuse(entries: object) -> None:
        raise ConnectionError("read-only")

    store.set_many = refuse  # type: ignore[method-assign]
    await embed(cache, "text")
    await settle()
    await embed(cache, "text")
    await settle()
    assert metrics.store_errors[("set", "error")] == 2
    assert store.calls["get"] == 2  # the second request still read the store: no cool-down after a failed write

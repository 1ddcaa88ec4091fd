import pytest

from batching import BatcherConfig, DepthScaledWait, FixedWait, Priority
from batching.admission import low_admission_limit


@pytest.mark.parametrize(
    "depth, expected_ms",
    [(0, 0.0), (1, 25 * (1 - 1 / 1.1)), (10, 12.5), (30, 25 * 0.75), (1000, 25 * (1 - 1 / 101))],
)
def test_depth_scaled_wait_follows_the_formula(depth, expected_ms):
    assert DepthScaledWait(max_wait_ms=25, scale_factor=10).wait_s(depth) == pytest.approx(expected_ms / 1000)


def test_depth_scaled_wait_grows_with_depth_and_stays_under_max_wait():
    policy = DepthScaledWait(max_wait_ms=25, scale_factor=15)
    waits = [policy.wait_s(d) for d in range(0, 2000, 7)]
    assert waits == sorted(waits)
    assert max(waits) < 0.025


def test_fixed_wait_ignores_depth():
    assert {FixedWait(0.05).wait_s(d) for d in (0, 1, 500)} == {0.05}


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_batch_size", 0),
        ("max_batch_cost", 0),
        ("max_wait_ms", -1),
        ("scale_factor", 0),
        ("max_concurrent_batches", 0),
        ("max_queue_depth", 0),
        ("batch_timeout_s", 0),
        ("max_retries", -1),
        ("low_share", 1.0),
        ("stall_factor", 0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BatcherConfig(**{field: value})


def test_config_defaults_match_the_contract():
    config = BatcherConfig()
    assert (config.max_batch_size, config.max_wait_ms, config.scale_factor) == (100, 25.0, 10.0)
    assert (config.max_concurrent_batches, config.max_queue_depth, config.max_retries) == (4, 10_000, 1)
    assert config.max_batch_cost is None and config.batch_timeout_s is None and config.dedupe
    assert low_admission_limit(config.max_queue_depth) == 8_000


def test_priority_parses_header_values():
    assert Priority.parse("low") is Priority.LOW
    assert Priority.parse(" HIGH ") is Priority.HIGH
    assert Priority.parse(Priority.LOW) is Priority.LOW
    with pytest.raises(ValueError, match="'high' or 'low'"):
        Priority.parse("urgent")

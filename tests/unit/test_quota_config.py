"""``limits:`` of a model entry: the provider's quota, checked at start-up with the field named."""

from __future__ import annotations

import pytest

from deployments.config import ConfigError, QuotaLimits, parse_app_config


def _openai(limits: object) -> dict:
    return {"models": [{"name": "m", "backend": "openai", "base_url": "http://upstream/v1", "limits": limits}]}


def test_limits_parse_with_their_defaults() -> None:
    (model,) = parse_app_config(_openai({"rpm": 3000, "tpm": 1_000_000})).models
    assert model.limits == QuotaLimits(rpm=3000, tpm=1_000_000, headroom=0.9, low_share=0.1)


def test_one_limit_is_enough() -> None:
    (model,) = parse_app_config(_openai({"tpm": 60_000, "headroom": 1})).models
    assert (model.limits.rpm, model.limits.tpm, model.limits.headroom) == (None, 60_000, 1)


def test_an_entry_without_limits_has_none() -> None:
    (model,) = parse_app_config({"models": [{"name": "m", "backend": "openai", "base_url": "http://u/v1"}]}).models
    assert model.limits is None


@pytest.mark.parametrize(("limits", "problem"), [
    ({"rpm": -5}, r"models\[0\]\.limits\.rpm: must be an integer >= 1"),
    ({"tpm": 0}, r"models\[0\]\.limits\.tpm: must be an integer >= 1"),
    ({"rpm": 10, "headroom": 1.5}, r"models\[0\]\.limits\.headroom: must be a number > 0 and <= 1, not 1\.5"),
    ({"rpm": 10, "headroom": -0.1}, r"models\[0\]\.limits\.headroom: must be a number > 0 and <= 1"),
    ({"rpm": 10, "low_share": 1}, r"models\[0\]\.limits\.low_share: must be a number >= 0 and < 1"),
    ({}, r"models\[0\]\.limits: set rpm, tpm or both"),
    ({"rpm": 10, "rps": 1}, r"models\[0\]\.limits: unknown setting\(s\) rps; allowed: headroom, low_share, rpm"),
    ("fast", r"models\[0\]\.limits: must be a mapping"),
])
def test_bad_limits_are_start_up_errors_naming_the_field(limits: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_app_config(_openai(limits))


def test_limits_on_a_local_model_are_a_start_up_error() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.limits: only the openai backend takes this option"):
        parse_app_config({"models": [{"name": "m", "backend": "local", "limits": {"rpm": 10}}]})

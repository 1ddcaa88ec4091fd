"""The re-run benchmark's second night: the share of documents edited and added, each edit a new text."""

from __future__ import annotations

import pytest

from load.bench.bulk_rerun import Settings, next_night
from load.workload import pseudo_sentences


def test_night_two_edits_and_adds_the_shares_asked_for() -> None:
    night_1 = pseudo_sentences(2000, 120, seed=0)
    night_2 = next_night(night_1, Settings(documents=2000))
    edited = [(old, new) for old, new in zip(night_1, night_2) if old != new]
    assert len(edited) == 100 and len(night_2) == 2040
    for old, new in edited:  # one word changed, in place
        old_words, new_words = old.split(), new.split()
        assert len(new_words) == len(old_words)
        assert sum(a != b for a, b in zip(old_words, new_words)) == 1
    assert not set(night_2[2000:]) & set(night_1)
    assert next_night(night_1, Settings(documents=2000)) == night_2  # the same corpus every run


def test_unknown_stores_are_refused() -> None:
    with pytest.raises(ValueError, match="--stores"):
        Settings(stores="disk,memcached")

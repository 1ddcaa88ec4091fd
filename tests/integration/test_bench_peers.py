"""Smoke run of the peers benchmark's measurement (``python -m load.bench peers``) on the session's running
application: no peer is installed or started and no second Ray instance. Every level answers with no error and the
service's vectors match sentence-transformers'. No timing is asserted."""

from __future__ import annotations

import pytest

from load.bench import peers

from .helpers import API_KEYS

pytestmark = pytest.mark.integration


def test_peers_measurement_covers_every_level_with_vectors_matching_the_reference(embeddings_app, tmp_path):
    target = peers.Target("service", embeddings_app.url, headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    runs = peers.measure([target], peers.QUICK)
    data = peers.report(runs, {"service": peers.service_about()}, peers.QUICK, tmp_path)
    assert (tmp_path / "peers.md").exists() and (tmp_path / "peers.json").exists()
    row = data["rows"]["service"]
    assert set(row["levels"]) == {level.name for level in peers.QUICK.levels}
    for level in row["levels"].values():
        assert level["texts_per_s"] > 0 and level["errors"] == 0
    assert runs["service"][0]["warmup_errors"] == 0
    assert row["min_cosine"] >= 0.999

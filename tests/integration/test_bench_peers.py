"""Smoke run of the peers benchmark's measurement (``python -m load.bench peers``) on the session's running
application: no peer is installed or started and no second Ray instance. Every level answers with no error and the
service's vectors match sentence-transformers', and the engine alone is reported beside it. No timing is asserted."""

from __future__ import annotations

import pytest

from load.bench import engine_limit, peers
from load.workload import pseudo_sentences

from .helpers import API_KEYS

pytestmark = pytest.mark.integration


def test_peers_measurement_covers_every_level_with_vectors_matching_the_reference(embeddings_app, tmp_path):
    target = peers.Target("service", embeddings_app.url, headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    runs = peers.measure([target], peers.QUICK)
    limits = [engine_limit.measure(pseudo_sentences(peers.QUICK.engine_texts))]
    data = peers.report(runs, {"service": peers.service_about()}, peers.QUICK, tmp_path, limits)
    assert (tmp_path / "peers.md").exists() and (tmp_path / "peers.json").exists()
    row = data["rows"]["service"]
    assert set(row["levels"]) == {level.name for level in peers.QUICK.levels}
    for level in row["levels"].values():
        assert level["texts_per_s"] > 0 and level["errors"] == 0
    assert runs["service"][0]["warmup_errors"] == 0
    assert row["min_cosine"] >= 0.999
    engine = data["engine_alone"]
    assert set(engine["arrangements"]) == {a.name for a in engine_limit.arrangements(engine["cores"])}
    assert engine["best_texts_per_s"] == max(a["texts_per_s"] for a in engine["arrangements"].values()) > 0
    assert "/ engine alone" in (tmp_path / "peers.md").read_text()

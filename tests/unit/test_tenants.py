"""Keys that name a tenant (deployments/ingress/auth.py): a keys file of hashed keys, each tenant's models and highest
priority enforced at the API with OpenAI's error shape, the file read again while the service runs, and each
tenant's usage counted under its name (never its key)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from batching import Priority
from deployments.ingress import auth
from deployments.ingress.api import create_api
from deployments.ingress.auth import ApiKeys, key_hash
from deployments.usage import COUNTS, TenantUsage, Totals

from .batch_fakes import MODEL, FakeModel

OTHER_MODEL = "other-embed"
SEARCH_KEY, INDEXER_KEY = "sk-search-0123", "sk-indexer-4567"


def keys_file(path: Path, *, search_keys: tuple[str, ...] = (SEARCH_KEY,)) -> Path:
    path.write_text(f"""
tenants:
  search:
    keys: [{", ".join(key_hash(key) for key in search_keys)}]
    models: [{MODEL}]
  indexer:
    keys: [{key_hash(INDEXER_KEY)}]
    max_priority: low
""")
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordedUsage(TenantUsage):
    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[tuple[str, str], list[int]] = {}

    def flush(self, totals: Totals) -> None:
        for key, counts in totals.items():
            self.totals[key] = [a + b for a, b in zip(self.totals.get(key, [0] * len(COUNTS)), counts)]


@pytest.fixture
def gateway(tmp_path: Path):
    models = {MODEL: FakeModel(), OTHER_MODEL: FakeModel()}
    usage = RecordedUsage()
    api = create_api(models, api_keys=ApiKeys([], path=keys_file(tmp_path / "keys.yaml")), usage=usage)
    with TestClient(api) as http:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=key, http_client=http, max_retries=0)

        yield client, models, usage, http


def test_each_key_acts_as_its_tenant_and_its_usage_is_counted_under_the_tenants_name(gateway) -> None:
    client, models, usage, http = gateway
    client(SEARCH_KEY).embeddings.create(model=MODEL, input=["one", "two"])
    client(INDEXER_KEY).embeddings.create(model=OTHER_MODEL, input="three")
    http.portal.call(usage.flush_now)
    assert models[MODEL].requests == [(["one", "two"], Priority.HIGH)]
    assert models[OTHER_MODEL].requests == [(["three"], Priority.LOW)]  # a batch-only key's requests are LOW
    assert usage.totals == {("search", MODEL): [1, 2, 2, 0, 0], ("indexer", OTHER_MODEL): [1, 1, 1, 0, 0]}


def test_a_tenants_requests_carry_its_share_to_the_model_and_a_plain_keys_carry_none(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants: {{heavy: {{keys: [{key_hash('sk-heavy')}], weight: 3}}}}")
    seen: list[Any] = []

    class Recording(FakeModel):
        def remote(self, requests: list[Any]) -> Any:
            seen.extend(request.share for request in requests)
            return super().remote(requests)

    for keys, key in ((ApiKeys([], path=path), "sk-heavy"), (ApiKeys(["sk-plain"]), "sk-plain")):
        with TestClient(create_api({MODEL: Recording()}, api_keys=keys)) as http:
            http.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers={"Authorization": f"Bearer {key}"})
    assert seen == [("heavy", 3.0), None]


def test_a_tenant_refused_a_model_or_a_priority_gets_a_403_in_openais_shape(gateway) -> None:
    client, models, _, _ = gateway
    with pytest.raises(openai.PermissionDeniedError) as other_model:
        client(SEARCH_KEY).embeddings.create(model=OTHER_MODEL, input="x")
    with pytest.raises(openai.PermissionDeniedError) as high:
        client(INDEXER_KEY).embeddings.create(model=MODEL, input="x", extra_headers={"X-Priority": "high"})
    for refused, param in ((other_model, "model"), (high, "X-Priority")):
        error = refused.value.body
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "permission_denied", param)
    assert models[MODEL].requests == models[OTHER_MODEL].requests == []
    with pytest.raises(openai.AuthenticationError) as unknown:
        client("sk-nobody").embeddings.create(model=MODEL, input="x")
    assert "sk-nobody" not in str(unknown.value.body)


def test_the_keys_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_keys_before(tmp_path: Path,
                                                                                           caplog) -> None:
    clock = Clock()
    path = keys_file(tmp_path / "keys.yaml", search_keys=(SEARCH_KEY, "sk-new-key"))
    keys = ApiKeys([], path=path, clock=clock)
    assert keys.check(f"Bearer {SEARCH_KEY}").name == "search"
    keys_file(path)  # "sk-new-key" revoked
    assert keys.check("Bearer sk-new-key").name == "search"  # not looked at again yet
    clock.now += auth.RELOAD_S
    with pytest.raises(auth.AuthenticationFailed):
        keys.check("Bearer sk-new-key")
    path.write_text("tenants: {search: {keys: [not-a-hash]}}")
    clock.now += auth.RELOAD_S
    assert keys.check(f"Bearer {SEARCH_KEY}").name == "search"
    assert "not read again" in caplog.text and SEARCH_KEY not in caplog.text


def test_a_plain_list_of_keys_is_every_key_the_default_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("key-one,\nkey-two\n")
    keys = ApiKeys.from_env({"EMBEDDINGS_API_KEYS_FILE": str(path)})
    assert [keys.check(f"Bearer {key}").name for key in ("key-one", "key-two")] == ["default", "default"]
    assert ApiKeys.from_env({}).check(None).name == "default" and not ApiKeys.from_env({}).required


@pytest.mark.parametrize("content, problem", [
    ("tenants: {a: {keys: [sha256:abc]}}", "tenants.a.keys.0"),
    (f"tenants: {{a: {{keys: [{key_hash('k')}]}}, b: {{keys: [{key_hash('k')}]}}}}", "one key to tenants"),
    (f"tenants: {{a: {{keys: [{key_hash('k')}], max_priority: urgent}}}}", "tenants.a.max_priority"),
])
def test_a_keys_file_that_is_wrong_is_refused_naming_where(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem.replace(".", r"\.")):
        ApiKeys([], path=path)


def test_the_hash_command_prints_a_keys_files_line(capsys: Any) -> None:
    auth.main(["hash", "sk-abc"])
    assert capsys.readouterr().out.strip() == key_hash("sk-abc")


def test_the_usage_api_shows_each_tenants_requests_and_tokens_to_admin_keys_only(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants: {{a: {{keys: [{key_hash('sk-a')}]}}, b: {{keys: [{key_hash('sk-b')}]}}, "
                    f"finance: {{keys: [{key_hash('sk-admin')}], admin: true, models: []}}}}")
    with TestClient(create_api({MODEL: FakeModel(), OTHER_MODEL: FakeModel()},
                               api_keys=ApiKeys([], path=path))) as http:
        def get(key: str, **query: Any):
            return http.get("/v1/organization/usage/embeddings", params=query,
                            headers={"Authorization": f"Bearer {key}"})

        for key, model, inputs in (("sk-a", MODEL, ["x", "y"]), ("sk-a", MODEL, ["z"]), ("sk-b", OTHER_MODEL, ["w"])):
            http.post("/v1/embeddings", json={"model": model, "input": inputs},
                      headers={"Authorization": f"Bearer {key}"})
        day = int(time.time()) // 86_400 * 86_400
        grouped = get("sk-admin", start_time=day, group_by=["project_id", "model"]).json()
        total = get("sk-admin", start_time=day, bucket_width="1h").json()
        refused = get("sk-a", start_time=day)
        invalid = get("sk-admin", start_time="yesterday")
    (bucket,) = grouped["data"]
    assert bucket["start_time"] == day and grouped["has_more"] is False
    assert sorted((r["project_id"], r["model"], r["num_model_requests"], r["input_tokens"])
                  for r in bucket["results"]) == [("a", MODEL, 2, 3), ("b", OTHER_MODEL, 1, 1)]
    assert [r["num_model_requests"] for b in total["data"] for r in b["results"]] == [3]
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "start_time"

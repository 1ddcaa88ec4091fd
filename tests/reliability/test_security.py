"""Security: keys kept and looked up only as their SHA-256 (no key in memory; what a lookup's time depends on is a
digest, which says nothing of a key), no key (client or upstream) in logs, metrics or error bodies, and the HTTP
proxy on loopback unless exposed on purpose."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments.config import parse_app_config
from deployments.errors import AuthenticationFailed
from deployments.ingress import auth
from deployments.ingress.auth import ApiKeys
from deployments.model.backends import ItemRejected
from deployments.model.backends.openai_api import OpenAIBackend
from deployments.secrets import SecretFileError, read_secret
from load.upstream import parse_args as upstream_args

from . import cluster
from .scenarios import CLIENT_KEYS, UPSTREAM_KEY, WRONG_UPSTREAM_KEY, Target

ROOT = Path(__file__).resolve().parents[2]
WRONG_CLIENT_KEY = "rel-wrong-client-key-77aa55cc33ee"


@pytest.mark.parametrize("presented", [CLIENT_KEYS[0], CLIENT_KEYS[1], WRONG_CLIENT_KEY, "x"])
def test_every_key_is_kept_and_looked_up_as_its_hash(monkeypatch: pytest.MonkeyPatch, presented: str) -> None:
    hashed: list[str] = []
    real = auth.key_hash

    def counting(key: str) -> str:
        hashed.append(key)
        return real(key)

    keys = ApiKeys([*CLIENT_KEYS, "a-third-key"])
    monkeypatch.setattr(auth, "key_hash", counting)
    try:
        keys.check(f"Bearer {presented}")
        accepted = True
    except AuthenticationFailed as failure:
        accepted = False
        assert presented not in failure.message
    assert accepted == (presented in CLIENT_KEYS)
    assert hashed == [presented]  # the presented key is hashed, and only its digest is looked up
    kept = repr(vars(keys))
    assert not any(key in kept for key in (*CLIENT_KEYS, "a-third-key"))  # no key is kept, only digests


def test_keys_come_from_a_file_and_a_bad_file_is_named_not_read_out(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{CLIENT_KEYS[0]}\n{CLIENT_KEYS[1]}\n")
    keys = ApiKeys.from_env({"EMBEDDINGS_API_KEYS_FILE": str(keys_file)})
    keys.check(f"Bearer {CLIENT_KEYS[1]}")
    with pytest.raises(AuthenticationFailed):
        keys.check(f"Bearer {WRONG_CLIENT_KEY}")
    with pytest.raises(SecretFileError) as missing:
        read_secret("UPSTREAM", {"UPSTREAM_FILE": str(tmp_path / "absent")})
    assert "UPSTREAM_FILE" in str(missing.value)


def test_a_secret_in_a_runtime_env_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        parse_app_config({
            "models": [{"name": "m", "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "UP",
                        "ray_actor_options": {"runtime_env": {"env_vars": {"UP": "sk-secret"}}}}],
            "ingress": {"env_vars": {"EMBEDDINGS_API_KEYS": "k"}},
        })
    assert "EMBEDDINGS_API_KEYS_FILE" in caplog.text and "UP_FILE" in caplog.text
    assert "sk-secret" not in caplog.text


async def test_upstream_errors_never_carry_the_upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream that quotes the key back (OpenAI's 401 does, partly) must not get it into an error."""
    monkeypatch.setenv("REL_UP_KEY", UPSTREAM_KEY)

    async def echoing_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status = 401 if b"auth" in body else 500 if b"crash" in body else 400
        headers = dict(scope["headers"])
        content = (b'{"error": {"message": "Incorrect API key provided: ' + headers[b"authorization"]
                   + b'", "type": "invalid_request_error", "param": null, "code": null}}')
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": content})

    backend = OpenAIBackend(base_url="http://upstream.invalid/v1", upstream_model="text-embedding-3-small",
                            api_key_env="REL_UP_KEY",
                            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=echoing_upstream)))
    messages = []
    for text in ("auth", "crash"):
        (outcome,) = await backend.embed([text])
        messages.append(str(outcome))
    with pytest.raises(ItemRejected, match="the upstream refused the input") as rejected:
        await backend.embed(["rejected"])
    messages.append(str(rejected.value))
    await backend.aclose()
    assert all(UPSTREAM_KEY not in message for message in messages), messages
    assert "401" in messages[0]


def test_the_http_proxy_binds_to_loopback_by_default() -> None:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    args, _ = upstream_args([])
    assert args.host == "127.0.0.1"


@pytest.mark.integration
def test_no_key_reaches_logs_metrics_or_error_bodies(faults: Target) -> None:
    bodies: list[str] = []
    with httpx.Client(timeout=60) as client:
        def post(model: str, key: str | None, text: str = "security check") -> httpx.Response:
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            response = client.post(faults.url, json={"model": model, "input": [text]}, headers=headers)
            bodies.append(response.text + " " + str(dict(response.headers)))
            return response

        assert post(faults.model, CLIENT_KEYS[0]).status_code == 200
        assert post(faults.model, CLIENT_KEYS[1]).status_code == 200
        assert post(faults.model, WRONG_CLIENT_KEY).status_code == 401
        assert post(faults.model, UPSTREAM_KEY).status_code == 401  # the upstream's key is no client key
        assert post(faults.model, None).status_code == 401
        faults.upstream.set_faults(error_rate=1.0)
        try:
            assert post(faults.model, CLIENT_KEYS[0], "upstream failing").status_code == 502
        finally:
            faults.upstream.set_faults(error_rate=0.0)
        refused = post("rel-badkey", CLIENT_KEYS[0], "wrong upstream key")
        assert refused.status_code == 502 and "upstream API key" in refused.json()["error"]["message"]
        metrics = client.get(cluster.metrics_url()).text
    assert "ray_batcher_" in metrics or "ray_serve_" in metrics, "the metrics endpoint served nothing"
    time.sleep(2.0)  # let the workers flush their log files
    sanity = subprocess.run(["grep", "-rlF", "-e", faults.deployment, str(cluster.logs_dir())], capture_output=True)
    assert sanity.stdout, "the grep below would search logs that say nothing of this application"
    secrets = [*CLIENT_KEYS, WRONG_CLIENT_KEY, UPSTREAM_KEY, WRONG_UPSTREAM_KEY]
    found = subprocess.run(["grep", "-rlF", *[arg for key in secrets for arg in ("-e", key)], str(cluster.logs_dir())],
                           capture_output=True, text=True)
    assert found.stdout == "", f"keys found in {found.stdout}"
    for key in secrets:
        assert key not in metrics
        assert all(key not in body for body in bodies), key

"""The documented ``@serve.batch`` example (docs/examples/serve_batch_dropin.py), deployed by ``serve run`` twice — as
written, on ``batching.batch``, and with its import line switched back to ``ray.serve.batch`` — answers the same
HTTP requests and handle calls, streaming included."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.helpers import ROOT, Service

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "docs" / "examples" / "serve_batch_dropin.py"
OUR_IMPORT = "from batching import batch  # was: from ray.serve import batch"
IMPORT_LINES = {"ours": OUR_IMPORT, "serve": "from ray.serve import batch"}
DEPLOYMENT = "Assistant"


@pytest.fixture(scope="module")
def dropin_apps(serve_instance: Service, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each variant deployed by ``serve run`` into the session's cluster, under ``/dropin-<variant>``."""
    import ray
    from ray import serve

    source = EXAMPLE.read_text()
    assert OUR_IMPORT in source
    address = ray.get_runtime_context().gcs_address
    apps = {}
    for variant, import_line in IMPORT_LINES.items():
        folder = tmp_path_factory.mktemp(f"dropin-{variant}")
        (folder / "assistant.py").write_text(source.replace(OUR_IMPORT, import_line))
        name = f"dropin-{variant}"
        run = subprocess.run(
            [str(Path(sys.executable).parent / "serve"), "run", "assistant:app", "--address", address,
             "--app-dir", str(folder), "--working-dir", str(folder), "--name", name, "--route-prefix", f"/{name}",
             "--non-blocking"],
            timeout=240, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        apps[variant] = name
    yield apps
    for name in apps.values():
        serve.delete(name)


def http_answers(url: str) -> tuple[list[dict], list[list[str]]]:
    async def run() -> tuple[list[dict], list[list[str]]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def score(i: int) -> dict:
                response = await client.post("/", json={"query": "red apple pie", "document": "apple pie " * i,
                                                        "weight": 0.5})
                response.raise_for_status()
                return response.json()

            async def generate(prompt: str) -> list[str]:
                async with client.stream("POST", "/generate", json={"prompt": prompt}) as response:
                    response.raise_for_status()
                    return [line async for line in response.aiter_lines() if line]

            scores = await asyncio.gather(*(score(i) for i in range(8)))
            streams = await asyncio.gather(generate("one two three"), generate("four"), generate("five six"))
            return scores, streams

    return asyncio.run(run())


@pytest.mark.parametrize("variant", list(IMPORT_LINES))
def test_the_example_answers_http_calls_batched_and_streamed(dropin_apps, serve_instance, variant):
    scores, streams = http_answers(f"{serve_instance.url}/{dropin_apps[variant]}")
    assert [s["score"] for s in scores] == [0.0] + [1.0] * 7
    assert max(s["batch"] for s in scores) > 1  # concurrent calls shared a batch
    assert streams == [["ONE", "TWO", "THREE"], ["FOUR"], ["FIVE", "SIX"]]


def test_both_imports_answer_handle_calls_alike(dropin_apps):
    from ray import serve

    async def calls(app: str) -> tuple[list[float], list[list[str]]]:
        handle = serve.get_deployment_handle(DEPLOYMENT, app_name=app)
        scores = await asyncio.gather(*(handle.score.remote(f"a b {i}", "a b c", weights=2.0) for i in range(4)))
        streaming = handle.options(stream=True)

        async def tokens(prompt: str) -> list[str]:
            return [token async for token in streaming.generate.remote(prompt)]

        return [s["score"] for s in scores], list(await asyncio.gather(tokens("x y"), tokens("z")))

    ours, theirs = (asyncio.run(calls(dropin_apps[variant])) for variant in IMPORT_LINES)
    assert ours == theirs == ([4.0, 4.0, 4.0, 4.0], [["X", "Y"], ["Z"]])

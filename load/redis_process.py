"""A throwaway ``redis-server`` (Debian's package) on a free loopback port, for the cache's tests and benchmark.

No persistence (nothing is written to disk), bounded by ``maxmemory`` with ``volatile-lru`` eviction (what the
README recommends for the cache), optionally password-protected. ``kill`` and ``start`` stop it hard and bring it
back on the same port, empty, as a crashed and restarted server would be.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

from load.bench.upstream_process import free_port


class RedisServer:
    def __init__(self, *, maxmemory: str = "256mb", password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.password = password
        self._command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                         "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-lru"]
        if password:
            self._command += ["--requirepass", password]
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL without the password (pass it apart, as the service reads it from its own variable)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def start(self, timeout_s: float = 10.0) -> None:
        self._process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.client() as probe:
                    probe.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

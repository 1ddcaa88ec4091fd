"""What a night brings to `embed-bulk`, against the service in its own process: the in-process app (the ingress's API
and a real `EmbeddingModel`, without Ray) in front of the simulated upstream, on a real port
(`python -m tests.reliability.inprocess_server`); faults are set on its upstream at run time.

The client runs as its own process every time, so signals are real. The random-moment cases (many runs) fork each
run from a `multiprocessing` fork server that has imported `embed_bulk` once: a real process running the command's
`main` to its interpreter's end (its threads joined), without paying the imports each time. The other cases run
`python -m embed_bulk` itself. After every fault the same command is run again, and its output must equal an
uninterrupted run's row for row, with nothing else left beside it.

A hang is a run still alive after `HANG_S`: it is killed and the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embed_bulk import main
from embed_bulk.interrupt import Interruption

REPO = Path(__file__).resolve().parents[2]
ROWS = 300
HANG_S = 60.0  # generous: a run that takes this long after a signal is hung, not slow
SIGNAL_WINDOW_S = 0.4  # signals land within this long after a run took its output's lock, before it can finish
UPSTREAM_FLAGS = ["--dim", "16", "--base-latency-ms", "30", "--jitter", "0.3", "--max-concurrency", "8"]
FORK_SERVER = multiprocessing.get_context("forkserver")
# Held to start a forked run and to read any run's state: `multiprocessing` is not thread-safe there (starting a
# process polls every other child, and two polls of one ended child race to read its exit status from the fork
# server: the loser reads end-of-file and reports 255).
PROCESS_TABLE = threading.Lock()


class Service:
    """The service (`python -m tests.reliability.inprocess_server`) on a fixed loopback port, which can be killed and
    started again there."""

    def __init__(self, log: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self._log = log
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.inprocess_server", "--port", str(self.port),
                 *UPSTREAM_FLAGS],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120  # its imports take seconds on a busy machine
        while not self._answers():
            assert self._process.poll() is None and time.monotonic() < deadline, self._log.read_text()[-2000:]
            time.sleep(0.05)

    def kill(self) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait()

    def set_faults(self, **faults: Any) -> None:
        request = urllib.request.Request(f"{self.root}/admin/faults", data=json.dumps(faults).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10):
            pass

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.root}/stats", timeout=1):
                return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    server = Service(tmp_path_factory.mktemp("service") / "service.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module", autouse=True)
def sigint_delivered() -> Iterator[None]:
    """SIGINT handled in this process while its tests run, so the runs they start (exec'd or forked) inherit it: a
    suite started as a shell script's background job inherits SIGINT ignored, which embed-bulk rightly keeps."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def fork_server() -> None:
    FORK_SERVER.set_forkserver_preload(["embed_bulk", __name__])


@dataclass(frozen=True)
class Job:
    """One output of the same documents: the command's arguments and where its runs' stderr goes."""

    directory: Path
    output_name: str
    service: Service
    extra: tuple[str, ...] = ()

    @property
    def output(self) -> Path:
        return self.directory / self.output_name

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.output_name}.lock"

    def argv(self) -> list[str]:
        return [str(self.directory / "docs.jsonl"), str(self.output), "--base-url", f"{self.service.root}/v1",
                "--batch-size", "10", "--concurrency", "2", "--max-retries", "8", "--grace", "1",
                "--progress", "never", *self.extra]

    def command(self) -> list[str]:
        return [sys.executable, "-m", "embed_bulk", *self.argv()]

    def log(self) -> Path:
        return self.directory.parent / f"{self.directory.name}.log"


def documents() -> list[str]:
    return [json.dumps({"id": f"doc-{i}", "text": f"document {i}: {'word ' * (i % 7)}"}) for i in range(ROWS)]


def write_documents(directory: Path, lines: list[str] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "docs.jsonl").write_text("\n".join(documents() if lines is None else lines) + "\n")


def wait_until(happened: Callable[[], bool], alive: Callable[[], bool], what: str) -> None:
    """Polls for `what` while the process it comes from is `alive`, for `HANG_S` at most."""
    deadline = time.monotonic() + HANG_S
    while not happened():
        assert alive() and time.monotonic() < deadline, f"{what}: not within {HANG_S} s or the process ended"
        time.sleep(0.01)


def run_command(job: Job, timeout_s: float = HANG_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(job.command(), cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def output_rows(job: Job) -> tuple[list[Any], np.ndarray]:
    """The ids and vectors of a finished output: `.npy` in its row order (input order); `.jsonl` sorted by id, as its
    rows come in the order batches finished."""
    if job.output.suffix == ".npy":
        ids = [json.loads(line) for line in (job.directory / f"{job.output_name}.ids.jsonl").read_text().splitlines()]
        return ids, np.load(job.output)
    rows = sorted((json.loads(line) for line in job.output.read_text().splitlines()), key=lambda row: row["id"])
    return [row["id"] for row in rows], np.array([row["embedding"] for row in rows], dtype=np.float32)


def files_beside(job: Job) -> set[str]:
    return {path.name for path in job.directory.iterdir()} - {"docs.jsonl"}


def finished_files(job: Job) -> set[str]:
    if job.output.suffix == ".npy":
        return {job.output_name, f"{job.output_name}.ids.jsonl"}
    return {job.output_name}


@pytest.fixture(scope="module")
def uninterrupted(service: Service, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[Any], Any]]:
    """Each output kind as an uninterrupted run of the command writes it."""
    rows = {}
    for name in ("out.npy", "out.jsonl"):
        job = Job(tmp_path_factory.mktemp("uninterrupted"), name, service)
        write_documents(job.directory)
        finished = run_command(job)
        assert finished.returncode == 0, finished.stderr
        rows[name] = output_rows(job)
    assert rows["out.npy"][0] == [f"doc-{i}" for i in range(ROWS)]
    return rows


def assert_same_rows(job: Job, expected: tuple[list[Any], np.ndarray]) -> None:
    ids, vectors = output_rows(job)
    assert ids == expected[0]
    assert vectors.dtype == np.float32 and np.array_equal(vectors, expected[1])
    assert files_beside(job) == finished_files(job), "nothing else is left beside the output"


def stderr_to(log: str) -> None:
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)


def run_cli(argv: list[str], log: str) -> None:
    """In a forked process: the command, its stderr to `log`."""
    stderr_to(log)
    sys.exit(main(argv))


def forked(target: Callable[..., None], *args: Any) -> multiprocessing.Process:
    process = FORK_SERVER.Process(target=target, args=args)
    with PROCESS_TABLE:
        process.start()
    return process


def forked_run(job: Job) -> multiprocessing.Process:
    return forked(run_cli, job.argv(), str(job.log()))


def alive(process: multiprocessing.Process) -> bool:
    with PROCESS_TABLE:
        return process.is_alive()


def ended(process: multiprocessing.Process) -> int | None:
    """Its exit status (negative: the signal that killed it), or None if it hung (then it is killed)."""
    hung = not multiprocessing.connection.wait([process.sentinel], HANG_S)
    if hung:
        os.kill(process.pid, signal.SIGKILL)
        multiprocessing.connection.wait([process.sentinel])
    with PROCESS_TABLE:
        process.join()
    return None if hung else process.exitcode


@dataclass
class Outcome:
    seed: int
    status: int | None  # of the run the signal was sent to
    rerun_status: int | None


def interrupt_and_rerun(job: Job, signum: int, seed: int) -> Outcome:
    """Signals a run at a seeded moment after it took its lock, then runs the same command again."""
    delay = random.Random(seed).uniform(0, SIGNAL_WINDOW_S)
    process = forked_run(job)
    deadline = time.monotonic() + HANG_S
    while not job.lock.exists() and alive(process) and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    if alive(process):
        os.kill(process.pid, signum)
    status = ended(process)
    return Outcome(seed, status, ended(forked_run(job)) if status is not None else None)


@pytest.mark.parametrize(("signum", "interrupted_status"), [(signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_run_signalled_at_random_moments_ends_and_the_same_command_completes_it_identically(
    service: Service, uninterrupted: dict[str, Any], fork_server: None, tmp_path: Path, signum: int,
    interrupted_status: int,
) -> None:
    wanted, outcomes = 20, []
    failed_reruns: dict[int, str] = {}  # seed: the stderr of its runs

    def case(seed: int) -> Outcome:
        job = Job(tmp_path / f"seed-{seed}", "out.npy" if seed % 2 == 0 else "out.jsonl", service)
        write_documents(job.directory)
        outcome = interrupt_and_rerun(job, signum, seed)
        if outcome.rerun_status == 0:
            assert_same_rows(job, uninterrupted[job.output_name])
        else:
            failed_reruns[seed] = job.log().read_text()
        return outcome

    with ThreadPoolExecutor(2) as runs:  # two at a time: the machine has two cores
        seed = 0
        while sum(outcome.status == interrupted_status for outcome in outcomes) < wanted and seed < 3 * wanted:
            outcomes.extend(runs.map(case, range(seed, seed + 4)))
            seed += 4

    interrupted = sum(outcome.status == interrupted_status for outcome in outcomes)
    print(f"{signal.Signals(signum).name}: {len(outcomes)} runs, {interrupted} interrupted (the others had finished), "
          f"reruns {Counter(outcome.rerun_status for outcome in outcomes)}")
    hung = [outcome.seed for outcome in outcomes if outcome.status is None or outcome.rerun_status is None]
    assert hung == [], f"runs that did not end within {HANG_S} s (seeds)"
    assert {outcome.status for outcome in outcomes} <= {interrupted_status, 0}, outcomes
    assert interrupted >= wanted, outcomes
    assert failed_reruns == {}, outcomes


@pytest.mark.parametrize(
    "faults",
    [pytest.param({"rpm": 1}, id="429-storm"), pytest.param({"slow_rate": 1.0, "slow_ms": 600_000}, id="no-answer")],
)
def test_sigterm_while_every_request_waits_ends_the_run_then_it_completes_when_the_service_recovers(
    service: Service, uninterrupted: dict[str, Any], tmp_path: Path, faults: dict[str, Any]
) -> None:
    job = Job(tmp_path / "job", "out.npy", service)
    write_documents(job.directory)
    service.set_faults(**faults)
    try:
        process = subprocess.Popen(job.command(), cwd=REPO, stderr=subprocess.PIPE, text=True)
        wait_until(job.lock.exists, lambda: process.poll() is None, f"{job.lock} written")
        time.sleep(0.5)  # its first requests are out: answered 429 and waiting to retry, or waiting for an answer
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=HANG_S)
    finally:
        service.set_faults(rpm=None, slow_rate=0.0, slow_ms=0.0)
    assert process.returncode == 143, stderr
    assert "SIGTERM: taking no new batches" in stderr and "interrupted" in stderr

    # After a storm the service paces to the requests a minute it learned, and learns the limit was lifted only from
    # its next call, up to one paced interval later: the rerun gets that interval on top of a hung run's allowance.
    paced_interval_s = 60.0 / faults["rpm"] if "rpm" in faults else 0.0
    rerun = run_command(job, HANG_S + paced_interval_s)

    assert rerun.returncode == 0, rerun.stderr
    assert_same_rows(job, uninterrupted["out.npy"])


def test_a_run_outlives_its_service_restarting_mid_job(uninterrupted: dict[str, Any], tmp_path: Path) -> None:
    service = Service(tmp_path / "restarted.log")
    service.start()
    # ~0.75 s at most 400 documents/s: cut mid-way; 3 retries give up before the service is back (rows fail)
    job = Job(tmp_path / "job", "out.npy", service, extra=("--max-rate", "400", "--max-retries", "3"))
    write_documents(job.directory)
    try:
        process = subprocess.Popen(job.command(), cwd=REPO, stderr=subprocess.PIPE, text=True)
        work_log = job.directory / "out.npy.partial.jsonl"
        wait_until(work_log.exists, lambda: process.poll() is None, f"{work_log} written")
        service.kill()
        time.sleep(0.5)
        service.start()
        _, stderr = process.communicate(timeout=HANG_S)
        rerun = run_command(job)
    finally:
        service.kill()

    assert process.returncode in (0, 1), stderr  # its retries carried it through, or rows failed for the rerun
    assert rerun.returncode == 0, rerun.stderr
    assert_same_rows(job, uninterrupted["out.npy"])


def test_a_second_run_on_the_same_output_is_refused_naming_the_first_which_is_unharmed(
    service: Service, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    job = Job(tmp_path / "job", "out.npy", service)
    write_documents(job.directory)
    service.set_faults(slow_rate=1.0, slow_ms=1_000)  # the first run is still in its first requests as others start
    try:
        first = subprocess.Popen(job.command(), cwd=REPO, stderr=subprocess.PIPE, text=True)
        wait_until(job.lock.exists, lambda: first.poll() is None, f"{job.lock} written")
        with ThreadPoolExecutor(2) as starts:
            others = list(starts.map(lambda _: run_command(job), range(3)))
    finally:
        service.set_faults(slow_rate=0.0, slow_ms=0.0)
    _, first_stderr = first.communicate(timeout=HANG_S)

    assert [other.returncode for other in others] == [75, 75, 75], [other.stderr for other in others]
    assert all(f"being written by another embed-bulk run (pid {first.pid})" in other.stderr for other in others)
    assert first.returncode == 0, first_stderr
    assert_same_rows(job, uninterrupted["out.npy"])


def test_malformed_lines_fail_alone_with_their_line_numbers_and_strict_refuses_the_file(
    service: Service, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    good = documents()
    bad = {2: "not json at all", 5: '["an", "array"]', 9: '{"text": "no id"}', 12: '{"id": [1], "text": "list id"}',
           15: '{"id": "doc-x", "body": "no text"}'}
    lines = good[:]
    for line_number in sorted(bad):
        lines.insert(line_number - 1, bad[line_number])
    lines.insert(20, "")
    lines.insert(30, "   ")
    job = Job(tmp_path / "job", "out.npy", service)
    write_documents(job.directory, lines)

    strict = subprocess.run([*job.command(), "--strict"], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert strict.returncode == 2 and "line 2: not valid JSON" in strict.stderr
    assert files_beside(job) == set(), "nothing embedded, nothing written"

    for _ in range(2):  # the rerun reports the same lines and keeps the output
        lenient = run_command(job)
        assert lenient.returncode == 1, lenient.stderr
        assert f"{ROWS + len(bad)} rows in input" in lenient.stderr
        listed = (job.directory / "out.npy.failures.jsonl").read_text().splitlines()
        failed = sorted((json.loads(line) for line in listed), key=lambda row: row["line"])  # as batches finished
        assert [row["line"] for row in failed] == sorted(bad)
        assert [row["id"] for row in failed] == [None, None, None, None, "doc-x"]
        assert all(row["error"].startswith(f"line {row['line']}: ") for row in failed)
        ids, vectors = output_rows(job)
        assert ids == uninterrupted["out.npy"][0] and np.array_equal(vectors, uninterrupted["out.npy"][1])


async def stubborn_job(log: str) -> None:
    """A job that never ends, swallowing every cancellation: what a library call stuck past its cancel amounts to."""
    os.write(2, b"ready\n")  # the signal handlers are in place
    while True:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)


def run_stubborn_job(grace_s: float, log: str, ignoring_sigint: bool) -> None:
    stderr_to(log)
    if ignoring_sigint:  # as a shell script starts a background job
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    Interruption(grace_s, stop=lambda: None).run(stubborn_job(log))


def started_stubborn_job(
    tmp_path: Path, grace_s: float, ignoring_sigint: bool = False
) -> tuple[multiprocessing.Process, Path]:
    log = tmp_path / "stubborn.log"
    process = forked(run_stubborn_job, grace_s, str(log), ignoring_sigint)
    wait_for_line(process, log, "ready")
    return process, log


def wait_for_line(process: multiprocessing.Process, log: Path, text: str) -> None:
    wait_until(lambda: log.exists() and text in log.read_text(), lambda: alive(process), f"{text!r} in the log")


def test_a_run_that_will_not_stop_is_ended_after_its_grace_and_cleanup(fork_server: None, tmp_path: Path) -> None:
    process, log = started_stubborn_job(tmp_path, grace_s=0.2)

    os.kill(process.pid, signal.SIGINT)

    assert ended(process) == 130
    assert "did not stop in time after the signal" in log.read_text()


def test_a_second_signal_ends_the_run_at_once(fork_server: None, tmp_path: Path) -> None:
    process, log = started_stubborn_job(tmp_path, grace_s=HANG_S * 10)  # only a second signal ends it

    os.kill(process.pid, signal.SIGTERM)
    wait_for_line(process, log, "SIGTERM: taking no new batches")
    os.kill(process.pid, signal.SIGINT)

    assert ended(process) == 130
    assert "second signal (SIGINT): exiting now" in log.read_text()


def test_a_sigint_ignored_when_the_run_began_stays_ignored(fork_server: None, tmp_path: Path) -> None:
    process, log = started_stubborn_job(tmp_path, grace_s=HANG_S * 10, ignoring_sigint=True)

    os.kill(process.pid, signal.SIGINT)
    os.kill(process.pid, signal.SIGTERM)
    wait_for_line(process, log, "SIGTERM: taking no new batches")
    os.kill(process.pid, signal.SIGTERM)

    assert ended(process) == 143
    assert "SIGINT" not in log.read_text()

"""One run per output at a time: an exclusive `flock` on `<out>.lock`, which names the holder's pid.

The kernel releases the lock when its holder dies, however it dies (`kill -9` too), so a lock is never stale; the
file itself is removed by the run that held it and left behind by a run that was killed, for the next to reuse.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from embed_bulk.settings import sidecar

PID_READ_TRIES = 20  # the holder writes its pid just after locking: a run refused in between waits for it a moment


class OutputBusy(RuntimeError):
    """Another run holds the output's lock."""

    def __init__(self, output_path: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "pid not known"
        super().__init__(f"{output_path} is being written by another embed-bulk run ({holder}); not starting a "
                         "second one. Run the command again once it has ended: it continues from what it saved.")
        self.pid = pid


@contextmanager
def output_lock(output_path: Path) -> Iterator[None]:
    """Holds `<out>.lock` for the block; `OutputBusy` at once if another run holds it."""
    path = sidecar(output_path, "lock")
    descriptor = _locked(path, output_path)
    try:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a run that opened this file meanwhile sees it gone
        os.close(descriptor)


def _locked(path: Path, output_path: Path) -> int:
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(descriptor)
            os.close(descriptor)
            raise OutputBusy(output_path, pid) from None
        if _same_file(descriptor, path):
            return descriptor
        os.close(descriptor)  # its holder removed the file as it finished: lock the one there now


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _holder(descriptor: int) -> int | None:
    for _ in range(PID_READ_TRIES):
        text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return int(text)
        time.sleep(0.005)
    return None

"""The lowest CPU priority, for work that may wait: what moves requests (HAProxy, the ingress, the replicas' event
loops, at the nice 15 Ray starts its workers with) then gets a core ahead of it, and the deferrable work still gets
every cycle nobody else wants."""

import os
import threading

LOWEST_PRIORITY = 19


def lowest_cpu_priority() -> None:
    """Nice 19 for the calling thread (Linux keeps a nice value per thread; threads it starts inherit it)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)

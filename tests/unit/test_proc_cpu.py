"""``load.proc_cpu``: processes grouped by what they are, and the CPU each group spent between two samples."""

from __future__ import annotations

import os

from load.proc_cpu import CpuMeter, process_group, sample, spent


def test_processes_are_grouped_by_ray_title_python_module_or_script_and_program() -> None:
    assert process_group(["ray::ServeReplica:embeddings:EmbeddingsIngress", ""]) == \
        "ray::ServeReplica:embeddings:EmbeddingsIngress"
    assert process_group(["/venv/bin/python3", "-m", "load.upstream", "--port", "1"]) == "python -m load.upstream"
    assert process_group(["python", "-c", "import x; x.main()"]) == "python -c"
    assert process_group(["/venv/bin/python", "-S", "-c", "import sys; sys.path = ['/a b']"]) == "python -c"
    assert process_group(["/venv/bin/python", "-u", "/venv/lib/ray/dashboard/dashboard.py"]) == "python dashboard.py"
    assert process_group(["/usr/sbin/haproxy", "-f", "haproxy.cfg"]) == "haproxy"
    assert process_group(["/venv/bin/python3 -c import sys; sys.path = ['/a', '/b']"]) == "python -c"
    assert process_group([]) == "?"


def test_spent_sums_each_group_counts_new_processes_from_zero_and_puts_the_largest_first() -> None:
    before = {1: ("raylet", 2.0), 2: ("ray::A", 1.0), 3: ("ray::A", 5.0)}
    after = {1: ("raylet", 2.5), 2: ("ray::A", 1.5), 3: ("ray::A", 6.0), 4: ("ray::B", 0.25)}
    assert list(spent(before, after).items()) == [("ray::A", 1.5), ("raylet", 0.5), ("ray::B", 0.25)]


def test_the_meter_reads_this_process_and_skips_pids_that_are_gone() -> None:
    meter = CpuMeter(lambda: [os.getpid(), 2**22 + 1])  # above the kernel's pid range: never a live process
    started = meter.start()
    assert list(started) == [os.getpid()]
    sum(i * i for i in range(300_000))  # some CPU for the meter to see (its amount is not asserted)
    (group, ms), = meter.ms_each(started, 4).items()
    assert group.startswith("python") and ms >= 0
    assert CpuMeter(None).start() == {} and CpuMeter(None).ms_each({}, 4) == {}  # nothing to measure
    assert sample([os.getpid()])[os.getpid()][1] >= started[os.getpid()][1]

"""The CPU seconds ``staleflow bench weight-sync`` reports: a process of the bench that leaves its
process tree between two readings takes nothing back (the suite once read -1.67 CPU s for a version,
a plain difference of two totals after a process under the test's worker went away)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from staleflow.bench.weight_sync import bench_cpu, cpu_since

#: a child that burns 0.4 s of CPU, then waits
_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(60)"
#: a parent that starts it, prints its pid and waits
_TREE = (f"import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', {_BURN!r}])\n"
         "print(child.pid, flush=True)\ntime.sleep(60)")


def test_a_process_that_leaves_the_tree_between_two_readings_takes_no_cpu_back():
    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        deadline = time.monotonic() + 30
        while sum(child.cpu_times()[:2]) < 0.3:
            assert time.monotonic() < deadline, "the child did not burn its CPU"
            time.sleep(0.05)
        before = bench_cpu()
        assert (child.pid, child.create_time()) in before
        parent.kill()  # the child is handed to init: no longer under this process
        parent.wait()
        deadline = time.monotonic() + 10
        while child.ppid() == parent.pid:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        after = bench_cpu()
        assert (child.pid, child.create_time()) not in after
        assert sum(after.values()) - sum(before.values()) < -0.2  # what a difference of totals reads
        assert cpu_since(before) >= 0
    finally:
        if child.is_running():
            os.kill(child.pid, signal.SIGKILL)

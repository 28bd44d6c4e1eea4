"""How many threads jitbyoc's kernels get from TVM's runtime thread pool.

TVM sizes its pool from ``TVM_NUM_THREADS``, else it halves the core count on x86 to
skip hyper-threads. On a VM whose cores have one thread each that leaves half the
machine idle (here: 1 of 2 cores). So when ``TVM_NUM_THREADS`` is unset, importing
jitbyoc sets it to the number of physical cores this process may run on; an explicit
``TVM_NUM_THREADS`` always wins. It takes effect when the pool first starts, i.e. when
jitbyoc is imported before any parallel TVM code has run.

TVM also pins each pool worker to one CPU (``TVM_BIND_THREADS``, on by default). A worker
pinned to a CPU that another process keeps busy cannot move, and every parallel launch
waits for it: RegNetY-800MF ran 356 ms instead of 13 with one busy process on CPU 1 of
2 (onnxruntime, whose threads are not pinned: 21 ms; unpinned, jitbyoc 25 ms, the same as
its one-thread time). So importing jitbyoc also sets ``TVM_BIND_THREADS=0`` unless it is
set; the OS then places the workers as it places onnxruntime's and torch's.
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs in this process's affinity mask."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def default_threads() -> None:
    os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))
    os.environ.setdefault("TVM_BIND_THREADS", "0")

"""A process that builds many distinct models does not grow with them.

Compiling in process used to keep ~60 KB per region: llvmlite never frees a module pass
manager (the whole O1 pipeline) and the global LLVM context keeps every module's constants
(:func:`jitbyoc.toolchain.compile_worker.optimized_module` frees both); what llvmlite still leaks
(~1.5 KB a pass builder: 0.5 MB over 300 models in process) is bounded in the worker
processes, which are recycled (:mod:`jitbyoc.toolchain.compile_pool`). The in-process memories (compiled code, partitions with
their lowered regions, runtime modules) are bounded. Before this, 300 distinct small
models grew the process by 18 MB (in process) to 64 MB.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import gc, sys
    import numpy as np, tvm
    from tvm import relax
    import jitbyoc
    from tests.conftest import build_model

    jitbyoc.cache.configure(enabled=False)  # every model is compiled, none read back

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    def model(i):
        return build_model({"x": ((i, 8), "float32"), "y": ((8,), "float32")},
                           lambda bb, x, y: bb.emit(relax.op.multiply(
                               relax.op.add(x, relax.const(1.0, "float32")), y)))

    WARM, N = 30, 300
    for i in range(1, WARM + N + 1):
        with jitbyoc.enabled():
            ex = tvm.compile(model(i), target="llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(np.ones((i, 8), "float32")),
                         tvm.runtime.tensor(np.full(8, 3, "float32")))
        assert (out.numpy() == 6).all()
        del vm, ex, out
        if i == WARM:
            gc.collect()
            base = rss_mb()
    gc.collect()
    print(f"{rss_mb() - base:.2f}")
""")


@pytest.mark.parametrize("workers", ["0", "2"], ids=["in_process", "pool"])
def test_300_distinct_models_grow_the_process_by_under_3_mb(workers):
    env = {**os.environ, "PYTHONPATH": ROOT, "JITBYOC_COMPILE_WORKERS": workers}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    growth = float(out.stdout.split()[-1])
    assert growth < 3.0, f"resident memory grew {growth:.1f} MB over 300 distinct models"

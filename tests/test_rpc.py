"""Remote runs (issue 15): a jitbyoc build exported with ``export_library`` runs on a TVM
RPC server (started here on loopback; the server never imports jitbyoc) and gives what
the local run gives; ``python -m bench --rpc`` measures there and checks its results."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from tests.conftest import build_model, run

pytest.importorskip("cloudpickle", reason="tvm.rpc needs the deploy extra (cloudpickle, psutil)")
pytest.importorskip("psutil", reason="tvm.rpc needs the deploy extra (cloudpickle, psutil)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A TVM RPC server on 127.0.0.1 (its own working directory); yields its port."""
    cwd = tmp_path_factory.mktemp("rpc-server")
    proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1",
                             "--port", "9190", "--port-end", "9290"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its session workers go with it (killpg)
    port = None
    for line in proc.stdout:
        found = re.search(r"bind to 127\.0\.0\.1:(\d+)", line)
        if found:
            port = int(found.group(1))
            break
    if port is None:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.skip("the TVM RPC server did not start")
    yield port
    # the server runs each session in a popen_worker child, which outlived a terminated
    # server (about 400 MB left behind per test run)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


def test_an_exported_jitbyoc_build_runs_remotely_as_it_runs_here(server, tmp_path):
    from tvm import rpc

    mod = build_model({"x": ((8, 32), "float32"), "w": ((32, 16), "float32")},
                      lambda bb, x, w: bb.emit(relax.op.nn.softmax(relax.op.nn.gelu(relax.op.matmul(x, w)))))
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    assert len(jitbyoc.last_report().regions) == 1
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 32)).astype("float32"), rng.standard_normal((32, 16)).astype("float32")
    ex.export_library(str(tmp_path / "softmax_model.so"))
    remote = rpc.connect("127.0.0.1", server)
    remote.upload(str(tmp_path / "softmax_model.so"))
    dev = remote.cpu()
    vm = relax.VirtualMachine(remote.load_module("softmax_model.so"), dev)
    got = vm["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)).numpy()
    np.testing.assert_array_equal(got, run(relax.VirtualMachine(ex, tvm.cpu()), x, w))


def test_the_bench_runs_on_the_server_and_checks_its_results(server, tmp_path, capsys):
    from bench import remote
    from bench import target as build_target

    build_target.set_target(None)
    args = argparse.Namespace(rpc=f"127.0.0.1:{server}", model=["mlp", "conv_block"], quick=False,
                              threads=None, repeat=2, cc=None, out=tmp_path)
    assert remote.main(args) == 0
    rows = json.loads((tmp_path / "remote.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["mlp", "conv_block"]
    for r in rows:
        assert r["ok"] and r["jitbyoc_max_rel_err"] < 1e-5 and r["jitbyoc_median_s"] > 0
    assert "conv_block" in capsys.readouterr().out

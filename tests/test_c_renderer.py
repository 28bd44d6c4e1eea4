"""The C rendering: it compiles with no TVM header, and run as TVM packed functions its
results are bit-for-bit those of the JIT, for every row of the op table and every dtype
(transcendentals included: both renderers emit the same primitive operations)."""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib

import numpy as np
import pytest
import tvm
import tvm_ffi.libinfo
from tvm import relax

import jitbyoc
from jitbyoc.ir.ops import OPS
from tests.conftest import (
    DTYPES,
    RELAX_ROWS,
    assert_bits_equal,
    build_model,
    call_region,
    jit_function,
    operand_dtype,
    relax_call,
    sample,
)
from tests.test_ops import attrs_of

CC = shutil.which("cc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
CFLAGS = ["-O2", "-ffp-contract=off"]  # no FMA contraction: the JIT rounds a*b + c twice


def compile_c(source: str, tmp_path) -> str:
    """``source`` as a shared library linked against libtvm_ffi (for the error path);
    first checks it compiles alone, with no TVM header, and without warnings."""
    c = tmp_path / "region.c"
    c.write_text(source)
    check = subprocess.run([CC, *CFLAGS, "-Wall", "-c", str(c), "-o", str(tmp_path / "region.o")],
                           capture_output=True, text=True)
    assert check.returncode == 0 and not check.stderr, check.stderr
    lib = tvm_ffi.libinfo.find_libtvm_ffi()
    libdir = lib.rsplit("/", 1)[0]
    so = tmp_path / "region.so"
    subprocess.run([CC, *CFLAGS, "-shared", "-fPIC", str(c), "-o", str(so), f"-L{libdir}",
                    "-l:" + lib.rsplit("/", 1)[1], f"-Wl,-rpath,{libdir}"], check=True)
    return str(so)


def c_and_jit(region, tmp_path):
    """The region's packed function from its C rendering, and from the JIT."""
    return tvm.runtime.load_module(compile_c(region.c_source, tmp_path))[region.symbol], jit_function(region)


def row_model(name: str):
    """Row ``name`` once per dtype (and astype target), operands broadcast (5, 37) against
    (1, 37) so both renderings walk strides and odd tails."""
    ops = [(dt, attrs) for dt in DTYPES if dt in OPS[name].dtypes for attrs in attrs_of(name, dt)]
    params = {f"op{j}_x{k}": ((5, 37) if k % 2 == 0 else (1, 37), operand_dtype(name, dt, k))
              for j, (dt, _) in enumerate(ops) for k in range(OPS[name].arity)}

    def body(bb, *xs):
        it = iter(xs)
        return [bb.emit(relax_call(name, [next(it) for _ in range(OPS[name].arity)], attrs))
                for _, attrs in ops]
    return build_model(params, body), ops


def inputs_for(name: str, ops, region, rng) -> list[np.ndarray]:
    arrays = []
    for buf, arg in zip(region.kernel.inputs, region.arg_names):
        j, k = map(int, re.fullmatch(r"op(\d+)_x(\d+)", arg).groups())
        arrays.append(sample(name, ops[j][0], k, buf.shape, rng, ops[j][1].get("to")))
    return arrays


@pytest.mark.parametrize("name", RELAX_ROWS)
def test_c_matches_jit_bit_for_bit(name, tmp_path):
    mod, ops = row_model(name)
    regions = jitbyoc.inspect(mod)
    assert sum(len(r.kernel.ops) for r in regions) == len(ops), "not everything was offloaded"
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for region in regions:
        c_fn, jit_fn = c_and_jit(region, tmp_path)
        arrays = inputs_for(name, ops, region, rng)
        for k, (got, want) in enumerate(zip(call_region(c_fn, region.kernel, arrays),
                                            call_region(jit_fn, region.kernel, arrays))):
            assert_bits_equal(got, want, f"{name}: output {k} of {region.symbol}, C vs JIT")


def test_c_symbolic_sizes_and_argument_errors(tmp_path):
    """Symbolic sizes are read from the arguments; a wrong argument raises the same
    error from the C entry as from the JIT's."""
    mod = build_model({"x": (("n", 8), "float32"), "y": ((1, 8), "float32")},
                      lambda bb, x, y: bb.emit(relax.op.nn.gelu(relax.op.multiply(x, y))))
    (region,) = jitbyoc.inspect(mod)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    rng = np.random.default_rng(1)
    for n in (1, 3, 40):
        arrays = [rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((1, 8)).astype("float32")]
        (got,), (want,) = call_region(c_fn, region.kernel, arrays), call_region(jit_fn, region.kernel, arrays)
        assert_bits_equal(got, want, f"n={n}")
    bad = [np.zeros((3, 8), "float32"), np.zeros((2, 8), "float32"), np.zeros((3, 8), "float32")]
    messages = []
    for fn in (c_fn, jit_fn):
        with pytest.raises(ValueError) as err:
            fn(*[tvm.runtime.tensor(a) for a in bad])
        messages.append(str(err.value))
    assert "expected shape (1, 8)" in messages[0] and messages[0] == messages[1]

"""Fused loops written as explicit vectors (lowering/llvm.py, lowering/vectors.py): kernel
epilogues on runs of their output box, and elementwise nests, with masked tails and
broadcast operands splatted. Checked against TVM's default build, exactly (every op here
is correctly rounded); and which regions still ask for LLVM's loop vectorizer."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc import partition_for_jitbyoc
from jitbyoc.toolchain.region import Region
from jitbyoc.render.optimization import GLUE, GLUE_VECTORS
from jitbyoc.tvm.codegen import region_of
from tests.conftest import build_both, build_model


def _regions(mod) -> dict[str, Region]:
    part = partition_for_jitbyoc(mod)
    return {str(f.attrs["global_symbol"]): region_of(f)
            for _, f in part.functions.items() if f.attrs and "Codegen" in f.attrs}


@st.composite
def permute_epilogue_cases(draw):
    """``permute_dims(x) + y`` then ``maximum(., z)``: the permute's fused epilogue reads
    ``y`` and ``z`` broadcast against the output in random patterns; sizes are rarely
    multiples of a vector (tails), dtypes 32 and 64 bits, float and int."""
    rank = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 37), min_size=rank, max_size=rank)))
    axes = tuple(draw(st.permutations(range(rank))))
    out = tuple(shape[a] for a in axes)

    def broadcast():
        keep = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
        drop = draw(st.integers(0, rank))  # leading dims absent
        return tuple(d if k else 1 for d, k in zip(out, keep))[drop:]

    dtype = draw(st.sampled_from(["float32", "float64", "int32", "int64"]))
    return shape, axes, broadcast(), broadcast(), dtype


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(permute_epilogue_cases(), st.integers(0, 2**31 - 1))
def test_vector_epilogue_matches_tvm(case, seed):
    shape, axes, ys, zs, dtype = case
    mod = build_model({"x": (shape, dtype), "y": (ys, dtype), "z": (zs, dtype)},
                      lambda bb, x, y, z: bb.emit(relax.op.maximum(
                          bb.emit(relax.op.add(bb.emit(relax.op.permute_dims(x, axes)), y)), z)))
    rng = np.random.default_rng(seed)
    args = [(rng.standard_normal(s) * 100).astype(dtype) for s in (shape, ys, zs)]
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(*args)
    np.testing.assert_array_equal(got, want, err_msg=f"{case}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from(["float32", "float64"]),
       st.sampled_from([(1, "n"), ("m", 1), ("m", "n"), (1, 1)]))
def test_vector_matmul_epilogue_matches_tvm(m, n, dtype, bias):
    """A GEMM's blocks get the epilogue box by box (edges of any width): bias of any
    broadcast pattern, then relu."""
    k = 8
    bshape = tuple({"m": m, "n": n}.get(d, d) for d in bias)
    mod = build_model({"a": ((m, k), dtype), "w": ((k, n), dtype), "b": (bshape, dtype)},
                      lambda bb, a, w, b: bb.emit(relax.op.nn.relu(
                          bb.emit(relax.op.add(bb.emit(relax.op.matmul(a, w)), b)))))
    rng = np.random.default_rng(m * 100 + n)
    # small integers: every product and sum is exact, so any summation order agrees
    args = [rng.integers(-4, 5, s).astype(dtype) for s in ((m, k), (k, n), bshape)]
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(*args)
    np.testing.assert_array_equal(got, want)


def test_regions_of_explicit_vectors_skip_the_loop_vectorizer():
    def region(params, body):
        (r,) = _regions(build_model(params, body)).values()
        return r

    gelu = region({"a": ((64, 32), "float32"), "w": ((32, 48), "float32"), "b": ((48,), "float32")},
                  lambda bb, a, w, b: bb.emit(relax.op.nn.gelu(
                      bb.emit(relax.op.add(bb.emit(relax.op.matmul(a, w)), b)))))
    assert gelu.pipeline == GLUE_VECTORS
    assert "<16 x float>" in gelu.llvm_ir and "splat (float" in gelu.llvm_ir
    chain = region({"x": ((50, 33), "float32"), "y": ((33,), "float32")},
                   lambda bb, x, y: bb.emit(relax.op.tanh(bb.emit(relax.op.add(x, y)))))
    assert chain.pipeline == GLUE_VECTORS
    # a bool output is stored as bytes: that nest stays scalar, for the loop vectorizer
    flags = region({"x": ((50, 33), "float32"), "y": ((33,), "float32")},
                   lambda bb, x, y: bb.emit(relax.op.less(x, y)))
    assert flags.pipeline == GLUE
    soft = region({"x": ((8, 40), "float32")}, lambda bb, x: bb.emit(relax.op.nn.softmax(x)))
    assert soft.pipeline == GLUE_VECTORS  # rows along the last axis are vectors
    across = region({"x": ((8, 40), "float32")}, lambda bb, x: bb.emit(relax.op.nn.softmax(x, axis=0)))
    assert across.pipeline == GLUE  # columns: scalar rows, for the loop vectorizer


def test_epilogues_over_narrow_rows_run_as_vectors():
    """A 7x7 map's epilogue box spans its 7-wide rows whole: one 49-long run of vectors
    per channel, not a scalar loop per row (EfficientNet's SiLU after its 7x7 convs cost
    more than the convs). Exact against TVM on small integers (relu), and the region asks
    for no loop vectorizer."""
    w = np.arange(-4, 5, dtype="float32").reshape(1, 1, 3, 3).repeat(32, 0)

    def body(bb, x, b):
        y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1, groups=32))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, b))))

    params = {"x": ((1, 32, 7, 7), "float32"), "b": ((1, 32, 1, 1), "float32")}
    (region,) = _regions(build_model(params, body)).values()
    assert region.pipeline == GLUE_VECTORS
    rng = np.random.default_rng(3)
    builds = build_both(build_model(params, body))
    want, got = builds.run(rng.integers(-3, 4, (1, 32, 7, 7)).astype("float32"),
                           rng.integers(-20, 20, (1, 32, 1, 1)).astype("float32"))
    np.testing.assert_array_equal(got, want)


def test_a_threaded_loop_reads_a_scalar_of_its_output_type_once():
    """A uint8 zero point beside a uint8 output: the threaded body's pointers are noalias
    (render.llvm.Ctx.reopen), so the optimized loop reads the zero point before it, not
    once per vector, nor the scale (pointers read back from the task's slots alone may
    alias the store)."""
    def body(bb, x, zp):
        return bb.emit(relax.op.quantize(x, relax.const(0.02, "float32"), zp, axis=-1, out_dtype="uint8"))

    mod = build_model({"x": ((64, 4096), "float32"), "zp": ((), "uint8")}, body)
    ir = jitbyoc.inspect(mod)[0].llvm_ir_optimized
    task = re.search(r"define[^\n]*_par0\(.*?\n\}", ir, re.S).group(0)
    blocks = dict(re.findall(r"\n([\w.]+):[^\n]*\n(.*?)(?=\n[\w.]+:|\Z)", task, re.S))
    succ = {name: set(re.findall(r"label %([\w.]+)", text)) for name, text in blocks.items()}

    def in_a_loop(start):
        seen, todo = set(), list(succ[start])
        while todo:
            b = todo.pop()
            if b == start:
                return True
            if b not in seen:
                seen.add(b)
                todo.extend(succ.get(b, ()))
        return False

    looped = [name for name in blocks if in_a_loop(name)]
    scalar_loads = [name for name in looped if "load i8" in blocks[name] or "load float" in blocks[name]]
    assert looped and not scalar_loads, scalar_loads

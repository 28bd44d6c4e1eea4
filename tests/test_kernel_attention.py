"""Fused attention (jitbyoc/kernels/attention.py): ``softmax(Q K^T * scale + mask) @ V``
as the frontends write it, with grouped-query heads, a symbolic length, the decoders'
guard against fully masked rows, float32 and float64. Differential against TVM's default
build and numpy, at lengths around the register tile and vector width; the C rendering
against the JIT'd code; and the fusion must really happen (an Attention stage), or stay
away where the scores leave the region."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc import engines
from jitbyoc.engines.gemm import blocking_for, panel_width
from jitbyoc.engines.gemm_micro import Micro
from jitbyoc.kernels.attention import Attention

from .conftest import build_both, build_model, run

LENGTHS = (1, 2, 7, 17, 64, 130)


def _attention(heads=4, kv=4, d=16, dtype="float32", guard=False, bool_mask=False, expose=False, length="s"):
    """The pattern of transformers' eager/sdpa attention through torch.export."""
    mask_dtype = "bool" if bool_mask else dtype

    def body(bb, q, k, v, mask):
        if kv != heads:  # repeat_kv: expand, broadcast, reshape
            def repeat(x):
                x = bb.emit(relax.op.expand_dims(x, 2))
                x = bb.emit(relax.op.broadcast_to(x, (1, kv, heads // kv, q.ty.shape[2], d)))
                return bb.emit(relax.op.reshape(x, (1, heads, q.ty.shape[2], d)))
            k, v = repeat(k), repeat(v)
        s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
        s = bb.emit(relax.op.multiply(s, relax.const(d ** -0.5, dtype)))
        if bool_mask:
            bias = bb.emit(relax.op.where(mask, relax.const(0.0, dtype), relax.const(float("-inf"), dtype)))
            s = bb.emit(relax.op.add(s, bias))
        else:
            s = bb.emit(relax.op.add(s, mask))
        p = bb.emit(relax.op.nn.softmax(s, axis=-1))
        if guard:  # where(every score of the row is -inf, 0, p)
            live = bb.emit(relax.op.logical_not(relax.op.equal(s, relax.const(float("-inf"), dtype))))
            flag = bb.emit(relax.op.max(bb.emit(relax.op.astype(live, "int8")), axis=-1, keepdims=True))
            dead = bb.emit(relax.op.logical_not(relax.op.astype(flag, "bool")))
            p = bb.emit(relax.op.where(dead, relax.const(0.0, dtype), p))
        o = bb.emit(relax.op.matmul(p, v))
        o = bb.emit(relax.op.permute_dims(o, [0, 2, 1, 3]))
        o = bb.emit(relax.op.reshape(o, (1, q.ty.shape[2], heads * d)))
        return [o, p] if expose else o
    n = length
    return build_model({"q": ((1, heads, n, d), dtype), "k": ((1, kv, n, d), dtype),
                        "v": ((1, kv, n, d), dtype), "mask": ((1, 1, n, n), mask_dtype)}, body)


def _inputs(n, heads=4, kv=4, d=16, dtype="float32", bool_mask=False, dead_rows=()):
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, h, n, d)).astype(dtype) for h in (heads, kv, kv))
    allowed = np.tril(np.ones((n, n), bool))
    for r in dead_rows:
        if r < n:
            allowed[r] = False
    mask = allowed if bool_mask else np.where(allowed, 0.0, -np.inf).astype(dtype)
    return q, k, v, mask[None, None]


def _stages(mod) -> list[str]:
    return [type(s).__name__ for r in jitbyoc.inspect(mod) for s in r.kernel.stages]


def _numpy(q, k, v, mask, heads, kv):
    rep = heads // kv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    bias = np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask
    o = Attention.reference(q.astype("float64"), k.astype("float64"), v.astype("float64"),
                            q.shape[-1] ** -0.5, bias.astype("float64"))
    return o.transpose(0, 2, 1, 3).reshape(1, q.shape[2], -1)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("heads,kv,d", [(4, 4, 16), (8, 2, 64), (3, 1, 20)])
def test_attention_fuses_and_matches_tvm_and_numpy_at_every_length(dtype, heads, kv, d):
    mod = _attention(heads, kv, d, dtype)
    assert "Attention" in _stages(mod)
    builds = build_both(mod)
    assert not builds.report.fallbacks, str(builds.report)
    tol = 3e-5 if dtype == "float32" else 1e-12
    for n in LENGTHS:
        x = _inputs(n, heads, kv, d, dtype)
        got, want = run(builds.jit, *x), run(builds.tvm, *x)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"length {n}")
        np.testing.assert_allclose(got, _numpy(*x, heads, kv), rtol=tol, atol=tol, err_msg=f"length {n}")


@pytest.mark.parametrize("bool_mask", [False, True])
def test_the_decoders_guard_fuses_and_zeroes_fully_masked_rows_like_tvm(bool_mask):
    mod = _attention(8, 4, 32, guard=True, bool_mask=bool_mask)
    assert "Attention" in _stages(mod)
    builds = build_both(mod)
    for n in (1, 5, 31):
        x = _inputs(n, 8, 4, 32, bool_mask=bool_mask, dead_rows=(0, 3))
        got, want = run(builds.jit, *x), run(builds.tvm, *x)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5, err_msg=f"length {n}")
        assert not got[0, 0].any()  # a dead row attends to nothing


def test_scores_that_leave_the_region_are_not_fused_and_stay_right():
    mod = _attention(4, 2, 16, expose=True)
    assert "Attention" not in _stages(mod)
    builds = build_both(mod)
    x = _inputs(9, 4, 2, 16)
    for got, want in zip(run(builds.jit, *x), run(builds.tvm, *x)):
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)


C_CASES = {  # heads, kv, d, dtype, guard, bool mask, length ("s": symbolic)
    "gqa-guard": (4, 2, 16, "float32", True, False, "s"),
    "f64-gqa": (8, 2, 64, "float64", False, False, "s"),
    "mqa-bool-guard": (3, 1, 20, "float32", True, True, "s"),
    "static": (4, 4, 16, "float32", False, False, 40),
}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the C export needs gcc")
@pytest.mark.parametrize("case", sorted(C_CASES))
def test_the_c_export_runs_the_fused_schedule_and_matches_tvm_and_numpy(case, tmp_path):
    """The C rendering is the same block schedule as the LLVM one, one lane wide, with
    products that sum k in order: against TVM's build, the JIT and numpy."""
    heads, kv, d, dtype, guard, bool_mask, length = C_CASES[case]
    mod = _attention(heads, kv, d, dtype, guard=guard, bool_mask=bool_mask, length=length)
    builds = build_both(mod)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="c")
    ex.export_library(str(tmp_path / "attention.so"), cc="gcc", options=["-O2", "-ffp-contract=off"])
    c_path = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "attention.so")), tvm.cpu())
    tol = 3e-5 if dtype == "float32" else 1e-12
    for n in (1, 7, 23, 130) if length == "s" else (length,):
        x = _inputs(n, heads, kv, d, dtype, bool_mask, dead_rows=(2,) if guard else ())
        got = run(c_path, *x)
        for want in (run(builds.tvm, *x), run(builds.jit, *x)):
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"length {n}")
        if not guard:
            np.testing.assert_allclose(got, _numpy(*x, heads, kv), rtol=tol, atol=tol, err_msg=f"length {n}")


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(2, 1), (4, 4), (6, 3)]), st.sampled_from([8, 24, 64, 96]), st.integers(1, 40),
       st.sampled_from(["float32", "float64"]), st.booleans())
def test_static_shapes_fuse_and_match_tvm(heads_kv, d, n, dtype, guard):
    """A static length gives the microkernels static edge tiles (a row count and a column
    count that are not multiples of the register tile)."""
    heads, kv = heads_kv
    mod = _attention(heads, kv, d, dtype, guard=guard, length=n)
    assert "Attention" in _stages(mod)
    builds = build_both(mod)
    x = _inputs(n, heads, kv, d, dtype, dead_rows=(n // 2,) if guard else ())
    tol = 3e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(run(builds.jit, *x), run(builds.tvm, *x), rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [128, 192])
def test_static_lengths_without_column_edges_emit_only_the_kernels_they_call(n):
    """With a static length and no column edge (N of both products a multiple of the
    register tile's width), an MR-row tile is always whole: the catch-all edge kernel of
    MR rows is not emitted (56 of the 211 KB of IR of BERT's attention region, a third of
    its compile). The edge tiles that remain (128 = 21 x 6 + 2 rows) still run right."""
    blk = blocking_for("float32")
    nr = panel_width("float32")
    mod = _attention(4, 4, nr, length=n)
    (region,) = [r for r in jitbyoc.inspect(mod) if "Attention" in [type(s).__name__ for s in r.kernel.stages]]
    kernels = {e for e in map(engines.parse, region.engines) if isinstance(e, Micro)}
    assert Micro("float32", blk.mr, blk.nv, blk.unroll, 0, 1) in kernels, kernels
    assert not {k for k in kernels if k.mr == blk.mr and not k.full}, kernels
    builds = build_both(mod)
    x = _inputs(n, 4, 4, nr)
    np.testing.assert_allclose(run(builds.jit, *x), run(builds.tvm, *x), rtol=3e-5, atol=3e-5)


def test_a_chain_stage_that_also_writes_a_region_output_is_not_fused():
    """An elementwise stage of the chain that stores a region output too would leave the
    output unwritten (only temporaries become row blocks): the chain stays as it is."""
    from jitbyoc.ir import kir
    from jitbyoc.kernels.attention import fuse_attention
    from jitbyoc.kernels.matmul import MatMul
    from jitbyoc.kernels.softmax import Softmax

    q, k, v = (kir.Buffer(f"in{i}", (4, 9, 16) if i != 1 else (4, 16, 9), "float32") for i in range(3))
    s, t, p = (kir.Buffer(f"tmp{i}", (4, 9, 9), "float32") for i in range(3))
    o, exposed = kir.Buffer("out0", (4, 9, 16), "float32"), kir.Buffer("out1", (4, 9, 9), "float32")
    scaled = kir.Op("multiply", (kir.Load(s), kir.Const(0.25, "float32")), "float32", "float32")
    stages = [MatMul((q, k), s), kir.Elementwise((4, 9, 9), ((t, scaled), (exposed, scaled))),
              Softmax((t,), p, axis=2), MatMul((p, v), o)]
    kernel = kir.Kernel("k", [q, k, v], [o, exposed], list(stages), [s, t, p])
    fuse_attention(kernel)
    assert [type(x).__name__ for x in kernel.stages] == ["MatMul", "Elementwise", "Softmax", "MatMul"]


def test_a_mask_built_before_the_first_layer_is_a_region_of_its_own():
    """BERT's extended attention mask is built once, between the first layer's V
    projection and its scores. It used to ride into the first layer's attention region,
    so that region's code differed from every other layer's (one more attention compile,
    160 ms). It is a region of its own now: every layer's attention is one code."""
    s, d, heads = 12, 16, 2
    rng = np.random.default_rng(3)
    ws = [relax.const(rng.standard_normal((d * heads, d * heads)).astype("float32")) for _ in range(6)]

    def body(bb, x, keep):
        def heads_of(y):
            y = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(x, y)), (1, s, heads, d)))
            return bb.emit(relax.op.permute_dims(y, [0, 2, 1, 3]))

        out = x
        for layer in range(2):
            q, k, v = (heads_of(w) for w in ws[3 * layer:3 * layer + 3])
            if layer == 0:  # the mask: (1 - keep) * -10000, as (1, 1, 1, S)
                mask = bb.emit(relax.op.subtract(relax.const(1.0, "float32"), keep))
                mask = bb.emit(relax.op.multiply(mask, relax.const(-10000.0, "float32")))
                mask = bb.emit(relax.op.expand_dims(mask, [1, 2]))
            scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            scores = bb.emit(relax.op.add(bb.emit(relax.op.multiply(scores, relax.const(d ** -0.5, "float32"))), mask))
            att = bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(scores, -1)), v))
            out = bb.emit(relax.op.add(out, bb.emit(relax.op.reshape(
                bb.emit(relax.op.permute_dims(att, [0, 2, 1, 3])), (1, s, heads * d)))))
        return out

    mod = build_model({"x": ((1, s, heads * d), "float32"), "keep": ((1, s), "float32")}, body)
    regions = jitbyoc.inspect(mod)
    attention = {r.kernel.name for r in regions if any(isinstance(t, Attention) for t in r.kernel.stages)}
    assert len(attention) == 1, attention
    x = rng.standard_normal((1, s, heads * d)).astype("float32")
    keep = (rng.random((1, s)) > 0.3).astype("float32")
    b = build_both(mod)
    want, got = b.run(x, keep)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

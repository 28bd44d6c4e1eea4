"""Grouped-query attention reads its shared key/value heads in place
(:mod:`jitbyoc.tvm.grouped`): the rewritten products equal the original ones (TVM's build
of each, numpy), and no repeated copy of the cache is left."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm.grouped import shared_heads
from tests.diff_util import build, run

HEADS, REPEAT, D = 2, 3, 8


def attention(past, new: int = 2, scaled: bool = True):
    """Scores and output of grouped-query attention as torch.export writes HF's
    ``repeat_kv`` (``past``: an int, or a name for a symbolic length)."""
    s = tvm.tirx.Var(past, "int64") if isinstance(past, str) else past
    q = relax.Var("q", relax.TensorType((1, HEADS * REPEAT, new, D), "float32"))
    k = relax.Var("k", relax.TensorType((1, HEADS, s, D), "float32"))
    v = relax.Var("v", relax.TensorType((1, HEADS, s, D), "float32"))
    bb = relax.BlockBuilder()

    def repeat(x):
        wide = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(x, [2])), (1, HEADS, REPEAT, s, D)))
        return bb.emit(relax.op.reshape(wide, (1, HEADS * REPEAT, s, D)))

    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(repeat(k), [0, 1, 3, 2]))
            if scaled:
                kt = bb.emit(relax.op.multiply(kt, relax.const(0.5, "float32")))
            q3 = bb.emit(relax.op.reshape(q, (HEADS * REPEAT, new, D)))
            scores = bb.emit(relax.op.matmul(q3, bb.emit(relax.op.reshape(kt, (HEADS * REPEAT, D, s)))))
            p = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit(relax.op.matmul(p, bb.emit(relax.op.reshape(repeat(v), (HEADS * REPEAT, s, D)))))
            result = bb.emit_output(relax.Tuple([scores, out]))
        bb.emit_func_output(result)
    return bb.get()


def reference(q, k, v, scaled: bool = True):
    kk, vv = (np.repeat(x[0], REPEAT, axis=0) for x in (k, v))
    scores = q[0] @ kk.transpose(0, 2, 1) * (0.5 if scaled else 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return scores, p @ vv


def arrays(past: int, new: int = 2):
    rng = np.random.default_rng(past)
    return [rng.standard_normal(shape).astype("float32")
            for shape in ((1, HEADS * REPEAT, new, D), (1, HEADS, past, D), (1, HEADS, past, D))]


def _ops(func) -> list[str]:
    return [b.value.op.name for blk in func.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]


@pytest.mark.parametrize("scaled", [True, False])
def test_products_read_the_shared_heads_and_mean_the_same(scaled):
    mod = attention(5, scaled=scaled)
    rewritten = tvm.IRModule({"main": shared_heads(mod, mod["main"])})
    assert "relax.broadcast_to" not in _ops(rewritten["main"])  # no repeated cache
    xs = arrays(5)
    want = reference(*xs, scaled=scaled)
    for m in (mod, rewritten):
        for got, w in zip(run(build(m, False), xs), want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    for got, w in zip(run(build(mod, True), xs), want):  # jitbyoc's prepare rewrites it
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_a_symbolic_past_builds_once_and_runs_every_length():
    with jitbyoc.enabled():
        ex = tvm.compile(attention("past"), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for past in (1, 9, 300):
        xs = arrays(past)
        got = vm["main"](*[tvm.runtime.tensor(a) for a in xs])
        for g, w in zip(got, reference(*xs)):
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


def test_a_repeat_read_by_other_ops_is_left_alone():
    """Only the products are rewritten; a per-head op the rewrite does not know (here an
    add of a tensor) leaves the product reading the copy."""
    q = relax.Var("q", relax.TensorType((HEADS * REPEAT, 2, D), "float32"))
    k = relax.Var("k", relax.TensorType((1, HEADS, 4, D), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k]):
        with bb.dataflow():
            wide = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(k, [2])), (1, HEADS, REPEAT, 4, D)))
            rep = bb.emit(relax.op.reshape(wide, (1, HEADS * REPEAT, 4, D)))
            bias = relax.const(np.ones((1, HEADS * REPEAT, 4, D), "float32"))
            kt = bb.emit(relax.op.permute_dims(bb.emit(relax.op.add(rep, bias)), [0, 1, 3, 2]))
            out = bb.emit_output(relax.op.matmul(q, bb.emit(relax.op.reshape(kt, (HEADS * REPEAT, D, 4)))))
        bb.emit_func_output(out)
    mod = bb.get()
    assert "relax.broadcast_to" in _ops(shared_heads(mod, mod["main"]))

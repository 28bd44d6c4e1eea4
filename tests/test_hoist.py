"""Broadcast subexpressions hoisted out of elementwise stages (jitbyoc.ir.hoist): a
squeeze-and-excitation block's sigmoid runs per channel, not per element of the map."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc import lower
from jitbyoc.ir import kir
from tests.diff_util import both, build, inputs, model, one_region, run

R = relax.op


def _ops(expr) -> list[str]:
    return [n.op for n in kir.walk([expr]) if isinstance(n, kir.Op)]


def _se(conv: bool):
    rng = np.random.default_rng(4)
    w = relax.const((rng.standard_normal((12, 8, 1, 1)) * 0.3).astype("float32"))

    def make(bb, vs, _):
        x, v = vs
        s = bb.emit(R.nn.conv2d(v, w)) if conv else v
        s = bb.emit(R.sigmoid(bb.emit(R.add(bb.emit(R.multiply(s, relax.const(2.0, "float32"))),
                                           relax.const(1.0, "float32")))))
        return bb.emit(R.multiply(x, s))

    return model([([((1, 12, 9, 7), "float32"), ((1, 8 if conv else 12, 1, 1), "float32")], None)], make)


@pytest.mark.parametrize("conv", [True, False])
def test_a_per_channel_sigmoid_runs_per_channel(conv):
    """``x * sigmoid(2 * s + 1)`` with ``s`` of shape ``(1, C, 1, 1)`` (from a 1x1 conv,
    or an input): the sigmoid is computed over ``(1, C, 1, 1)`` (the conv's epilogue, or
    a stage of its own), and the stage over the map only multiplies; results bit for bit
    those of the unhoisted expression, and within tolerance of TVM's build."""
    mod = _se(conv)
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    big = [s for s in region.kernel.stages if isinstance(s, kir.Elementwise) and s.shape == (1, 12, 9, 7)]
    assert len(big) == 1 and all(_ops(e) == ["multiply"] for _, e in big[0].stores)
    small = [op for s in region.kernel.stages
             for op in (_ops(s.epilogue) if isinstance(s, kir.KernelStage) and s.epilogue is not None
                        else [o for _, e in s.stores for o in _ops(e)] if isinstance(s, kir.Elementwise)
                        and s.shape == (1, 12, 1, 1) else [])]
    assert "sigmoid" in small
    arrays = inputs([([((1, 12, 9, 7), "float32"), ((1, 8 if conv else 12, 1, 1), "float32")], None)])
    got, ref = both(mod, arrays)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lower, "hoist_broadcast_subexpressions", lambda kernel, make_temp: None)
        plain = run(build(mod, True), arrays)
    np.testing.assert_array_equal(got[0], plain[0])


def test_cheap_broadcast_parts_stay_inline():
    """``x * (s + 1)``: no expensive op in the broadcast part, no extra stage or temp."""
    mod = model([([((1, 12, 9, 7), "float32"), ((1, 12, 1, 1), "float32")], None)],
                lambda bb, vs, _: bb.emit(R.multiply(vs[0], bb.emit(R.add(vs[1], relax.const(1.0, "float32"))))))
    (region,) = jitbyoc.inspect(mod)
    assert [type(s).__name__ for s in region.kernel.stages] == ["Elementwise"] and not region.kernel.temps

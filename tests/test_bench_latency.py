"""``python -m bench.latency``'s "one layer changed" build: the first op of a known pair
swapped, so that exactly one region is compiled again."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

from bench.latency import change_one_layer
from tests.conftest import build_model


def _ops(mod) -> list[str]:
    names: list[str] = []
    relax.analysis.post_order_visit(mod["main"], lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def test_a_model_without_activations_gets_its_first_add_changed():
    """MobileNetV2's ReLU6 is a clip: its first add becomes a subtract, nothing else moves."""
    def body(bb, x, b):
        y = bb.emit(relax.op.clip(bb.emit(relax.op.add(x, b)), 0.0, 6.0))
        return bb.emit(relax.op.add(y, b))
    mod = build_model({"x": ((2, 8), "float32"), "b": ((8,), "float32")}, body)
    before, after = _ops(mod), _ops(change_one_layer(mod))
    assert before == ["relax.add", "relax.clip", "relax.add"]
    assert after == ["relax.subtract", "relax.clip", "relax.add"]


def test_an_activation_is_changed_before_an_add():
    mod = build_model({"x": ((2, 8), "float32")},
                      lambda bb, x: bb.emit(relax.op.sigmoid(bb.emit(relax.op.add(x, x)))))
    assert _ops(change_one_layer(mod)) == ["relax.add", "relax.tanh"]


def test_a_model_with_nothing_to_change_says_so():
    mod = build_model({"x": ((2, 8), "float32")}, lambda bb, x: bb.emit(relax.op.multiply(x, x)))
    with pytest.raises(ValueError, match="nothing|no relu"):
        change_one_layer(mod)

"""A concatenation's parts made in its region are written in place
(:mod:`jitbyoc.kernels.concat_parts`): the region's results equal TVM's build, its C
rendering equals its machine code, and parts stay copied where placing would change them.
"""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import jitbyoc
from tests.conftest import build_both, build_model
from tests.diff_util import CC, check_c_matches_llvm

R = relax.op
PARTS = {"a": ((1, 8, 11, 11), "float32"), "b": ((1, 5, 11, 11), "float32"), "c": ((1, 3, 11, 11), "float32")}


def _pool(x):
    return R.nn.max_pool2d(x, 3, 1, padding=1)


def _inputs(parts: dict) -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    return [rng.standard_normal(s).astype(d) for s, d in parts.values()]


def _region(mod):
    (region,) = jitbyoc.inspect(mod)
    return region.kernel


def _placements(kernel) -> dict:
    return {t.name: (dest.name, offset) for t, (dest, offset) in kernel.placed.items()}


def _check_equal_to_tvm(mod, parts: dict) -> None:
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    want, got = builds.run(*_inputs(parts))
    for w, g in zip(*(v if isinstance(v, list) else [v] for v in (want, got))):
        np.testing.assert_array_equal(g, w)


def test_parts_made_in_the_region_are_written_in_place():
    """Both pooled parts live in the output at their channel offsets; the concatenation
    copies only ``b``, a region input."""
    mod = build_model(PARTS, lambda bb, a, b, c: bb.emit(R.concat([bb.emit(_pool(a)), b, bb.emit(_pool(c))], axis=1)))
    kernel = _region(mod)
    assert sorted(_placements(kernel).values()) == [("out0", 0), ("out0", 13 * 121)]
    (concat,) = [s for s in kernel.stages if type(s).__name__ == "Concat"]
    assert concat.placed == (0, 2) and concat.out.name == "out0"
    _check_equal_to_tvm(mod, PARTS)


def test_nested_concatenations_place_through_each_other():
    """DenseNet's form: a concatenation of a concatenation, every part placed, no copy left."""
    mod = build_model(PARTS, lambda bb, a, b, c: bb.emit(R.concat(
        [bb.emit(R.concat([bb.emit(_pool(a)), bb.emit(_pool(b))], axis=1)), bb.emit(_pool(c))], axis=1)))
    kernel = _region(mod)
    assert len(kernel.placed) == 4
    assert not [s for s in kernel.stages if type(s).__name__ == "Concat"]
    _check_equal_to_tvm(mod, PARTS)


def test_a_part_read_after_an_epilogue_that_rewrites_the_result_stays_apart():
    """``relu(concat([p, q]))`` applies the relu in the concatenation's result: ``p``, which
    a softmax reads afterwards, must keep its own buffer (unrectified); ``q`` is placed."""
    def body(bb, a, b, c):
        p = bb.emit(_pool(a))
        cat = bb.emit(R.concat([p, bb.emit(_pool(b))], axis=1))
        return [bb.emit(R.nn.relu(cat)), bb.emit(R.nn.softmax(p, axis=1))]
    mod = build_model(PARTS, body)
    kernel = _region(mod)
    (concat,) = [s for s in kernel.stages if type(s).__name__ == "Concat"]
    assert concat.epilogue is not None and concat.placed == (1,)
    builds = build_both(mod)
    (want_cat, want_soft), (got_cat, got_soft) = builds.run(*_inputs(PARTS))
    np.testing.assert_array_equal(got_cat, want_cat)
    np.testing.assert_allclose(got_soft, want_soft, rtol=1e-6, atol=1e-7)


def test_parts_of_a_batch_are_not_contiguous_and_stay_copied():
    parts = {k: ((2,) + s[1:], d) for k, (s, d) in PARTS.items()}
    mod = build_model(parts, lambda bb, a, b, c: bb.emit(R.concat([bb.emit(_pool(a)), b, bb.emit(_pool(c))], axis=1)))
    assert _region(mod).placed == {}
    _check_equal_to_tvm(mod, parts)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_places_parts_alike(tmp_path):
    mod = build_model(PARTS, lambda bb, a, b, c: bb.emit(R.concat(
        [bb.emit(R.concat([bb.emit(_pool(a)), b], axis=1)), bb.emit(_pool(c))], axis=1)))
    check_c_matches_llvm(mod, _inputs(PARTS), tmp_path)


BIG = {"a": ((1, 37, 30, 30), "float32"), "b": ((1, 5, 30, 30), "float32"), "c": ((1, 19, 30, 30), "float32")}


@pytest.mark.parametrize("raw", [True, False])
def test_a_large_channel_concatenation_copies_in_blocks_on_threads(raw, tmp_path):
    """DenseNet's form at its sizes' scale: region inputs copied into a batch-1 channel
    concatenation of 54,900 elements, a part made in the region placed between them,
    rectified (an epilogue of the concatenation where the raw result is not returned as
    well). The copy runs as 16 tasks of channel ranges that cross the parts' boundaries
    (it was one serial copy in the region's entry), each with the epilogue over its
    range; equal to TVM's build and to the C rendering."""
    def body(bb, a, b, c):
        cat = bb.emit(R.concat([a, bb.emit(_pool(b)), c], axis=1))
        out = bb.emit(R.nn.relu(bb.emit(R.negative(cat))))
        return [cat, out] if raw else out
    mod = build_model(BIG, body)
    (concat,) = [s for s in _region(mod).stages if type(s).__name__ == "Concat"]
    assert concat.blocks() == 16 and concat.placed == (1,) and (concat.epilogue is None) == raw
    _check_equal_to_tvm(mod, BIG)
    if CC is not None:
        check_c_matches_llvm(mod, _inputs(BIG), tmp_path)

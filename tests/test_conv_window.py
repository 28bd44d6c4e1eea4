"""The direct convolution engine's unrolled window (:func:`conv_plan.unrolled_window`):
which windows it takes, what the engine compiles to, and that it computes what the
looped taps and numpy compute, on every geometry of the conv grid."""

import re

import pytest

import jitbyoc
from jitbyoc.engines import conv_engine, conv_plan
from jitbyoc.engines.conv_plan import Layout, Plan
from tests.spatial_util import grid_model, random_inputs
from tests.test_kernel_conv import CONV1D, CONV2D, F32, cases, check, conv, outputs_with_plan


def geometry(x_shape, w_shape, attrs):
    """The ConvGeometry jitbyoc plans for one conv."""
    (region,) = jitbyoc.inspect(grid_model(cases([(x_shape, w_shape, attrs)]), conv))
    (stage,) = region.kernel.stages
    return stage.geo


@pytest.mark.parametrize("x_shape, w_shape, attrs, dense, window", [
    ((1, 8, 14, 14), (8, 8, 3, 3), dict(padding=1), False, (3, 3)),
    ((1, 8, 14, 14), (8, 8, 5, 5), dict(padding=2), False, (5, 5)),
    ((1, 8, 14, 14), (8, 8, 1, 1), {}, False, (1, 1)),
    ((1, 8, 14, 14), (8, 8, 3, 1), {}, False, (3, 1)),
    ((1, 8, 14, 14), (8, 8, 3, 3), dict(strides=(2, 1)), False, (3, 3)),  # row stride: any
    ((1, 8, 14, 14), (8, 8, 3, 3), dict(strides=(1, 2)), False, (0, 0)),  # columns in two planes
    ((1, 8, 14, 14), (8, 8, 3, 3), dict(dilation=(1, 2)), False, (0, 0)),  # columns 2 apart
    ((1, 8, 14, 14), (8, 8, 3, 3), dict(padding=1), True, (0, 0)),  # a plane per column
    ((1, 8, 14, 14), (8, 8, 7, 7), dict(padding=3), False, (0, 0)),  # 49 taps: looped
])
def test_unrolled_window_takes_rows_of_consecutive_taps(x_shape, w_shape, attrs, dense, window):
    geo = geometry(x_shape, w_shape, attrs)
    assert conv_plan.unrolled_window(Plan(Layout(geo, dense), 8, 4, 3, geo.oh)) == window


def test_unrolled_engine_has_no_tap_loop():
    """A 3x3 window on AVX2's 4x3 block compiles to 9 x 12 FMAs per channel, one basic
    block; the looped engine has 12 per trip of its tap loop."""
    from jitbyoc.toolchain import jit
    from jitbyoc.engines import ir_text
    from jitbyoc.render import isa

    def fmas_per_block(engine):
        optimized = jit.optimize(ir_text(engine, isa.current().triple, jit.data_layout()), engine.pipeline)
        blocks = re.split(r"\n\S+:", optimized)  # a basic block's label starts a line
        return max(block.count("@llvm.fma.v8f32(") for block in blocks)

    assert fmas_per_block(conv_engine.ConvEngine(F32, 8, 4, 3, 1, 3, 3)) == 9 * 12
    assert fmas_per_block(conv_engine.ConvEngine(F32, 8, 4, 3, 1)) < 9 * 12


GRID = [(False, 16, 16, 1, 3), (False, 8, 4, 3, 2)]


@pytest.mark.parametrize("plan", GRID)
def test_unrolled_and_looped_windows_match_numpy(plan, monkeypatch):
    """Every conv of the grid (grouped, strided, dilated, padded, 1-D) on the grid layout,
    with the window unrolled where it can be and with every window looped: both within
    the accumulation bound of the float64 reference, and the two engines are the ones
    asked for (the region's code calls the engine with or without a window)."""
    unrolled = 0
    for index, case in enumerate(CONV2D + CONV1D):
        cs = cases([case])
        args = random_inputs(cs, seed=index)
        geo = geometry(*case)
        window = conv_plan.unrolled_window(Plan(Layout(geo, False), *plan[1:4], geo.oh))
        unrolled += window != (0, 0)
        for looped in (False, True):
            if looped:
                monkeypatch.setattr(conv_engine, "unrolled_window", lambda _plan: (0, 0))
            (got,) = outputs_with_plan(grid_model(cs, conv), args, plan, 1)
            check(got, *args, cs[0][1])
            monkeypatch.undo()
    assert unrolled >= 6

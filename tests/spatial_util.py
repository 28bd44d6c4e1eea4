"""Helpers shared by test_kernel_conv and test_kernel_pool: build a BlockBuilder model
of many independent ops (one TVM build covers a whole grid), run it with and without
jitbyoc, and run one region's C rendering compiled with the system C compiler."""

from __future__ import annotations

import shutil

import numpy as np
from tvm import relax

from tests import diff_util
from tests.diff_util import build, run  # noqa: F401 - re-exported for the conv/pool tests

CC = shutil.which("cc")


def grid_model(cases, make):
    """``main(x0, w0, x1, w1, ...) -> (y0, y1, ...)`` with ``yk = make(bb, *vars_k, case_k)``.

    ``cases`` are ``(shapes, attrs)`` pairs; ``shapes`` a list of (shape, dtype) inputs."""
    bb = relax.BlockBuilder()
    params, groups = [], []
    for k, (shapes, _) in enumerate(cases):
        vs = [relax.Var(f"a{k}_{i}", relax.TensorType(s, d)) for i, (s, d) in enumerate(shapes)]
        params += vs
        groups.append(vs)
    with bb.function("main", params):
        with bb.dataflow():
            outs = [make(bb, *vs, attrs) for vs, (_, attrs) in zip(groups, cases)]
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(out)
    return bb.get()


def random_inputs(cases, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(d) for shapes, _ in cases for s, d in shapes]


def run_c(region, inputs: dict[str, np.ndarray], out_shape, dtype, tmp_path) -> np.ndarray:
    """``region``'s C rendering called on ``inputs`` (by argument name); its single output."""
    (out,) = diff_util.run_c(region, inputs, tmp_path)
    assert out.shape == tuple(out_shape) and str(out.dtype) == dtype
    return out

"""A product's elementwise tail with several stores runs in the product's blocks
(``lower._fuse_stores``): a residual block's ``relu(conv + x)`` kept in float32 for the
next sum and cast to bfloat16 for the next product was a pass of its own over the
product's whole float32 result. And a product whose sums only its epilogue reads (it
writes another dtype) keeps them in a scratch of its own (``gemm_llvm.scratch_c``), not
in a temp the size of the output. Against TVM's build of the same module."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc.engines import gemm_llvm
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.kernels.matmul import MatMul
from tests.conftest import build_both, build_model, call_region
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit

R = relax.op
BF16 = ml_dtypes.bfloat16
U = 2.0 ** -24  # float32's unit roundoff
# (kind, x shape, weight shape, residual shape): a 3x3 conv with padding, a linear layer
# whose rows and columns end in partial tiles
CASES = {"conv": ((1, 16, 12, 12), (32, 16, 3, 3), (1, 32, 12, 12)),
         "batch": ((2, 16, 11, 9), (40, 16, 3, 3), (2, 40, 11, 9)),
         "matmul": ((70, 96), (96, 84), (70, 84)),
         # 196 columns are four panels, too few to share out: chunks are rows
         # (gemm_llvm.split_side), and so are the scratch's (scratch_c)
         "rows": ((128, 96), (96, 196), (128, 196))}


def _residual_block(kind: str, w: np.ndarray, precision: str, cast: bool = True):
    """``y = relu(op(x, w) + r)``, returned as float32 and (``cast``) as bfloat16."""
    x_shape, _, r_shape = CASES[kind]

    def body(bb, x, r):
        wc = relax.const(w)
        op = R.matmul(x, wc) if kind in ("matmul", "rows") else R.nn.conv2d(x, wc, padding=1)
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(op), r))))
        return [y, bb.emit(R.astype(y, "bfloat16"))] if cast else y
    mod = build_model({"x": (x_shape, "float32"), "r": (r_shape, "float32")}, body)
    return jitbyoc.lower_precision(mod) if precision == "bf16" else mod


def _product(mod):
    """The product stage of the module's region, and the region's stages."""
    (region,) = [r for r in jitbyoc.inspect(mod) if any(isinstance(s, (Conv2d, MatMul)) for s in r.kernel.stages)]
    (stage,) = [s for s in region.kernel.stages if isinstance(s, (Conv2d, MatMul))]
    return stage, region.kernel.stages


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["conv", "batch", "matmul", "rows"])
def test_a_residual_tail_with_two_stores_runs_in_the_products_blocks(kind, precision):
    rng = np.random.default_rng(len(kind) + len(precision))
    x_shape, w_shape, r_shape = CASES[kind]
    w = rng.standard_normal(w_shape).astype(np.float32)
    mod = _residual_block(kind, w, precision)
    stage, stages = _product(mod)
    assert stages[-1] is stage and len(stage.epilogue_also) == 1, stages
    assert {b.dtype for b, _ in stage.epilogue_stores()} == {"float32", "bfloat16"}
    x, r = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(r_shape).astype(np.float32)
    builds = build_both(mod)
    (want, _), (got, got_bf16) = builds.run(x, r)
    # both stores come from the same sums: the cast is the float32 result's, bit for bit
    assert np.array_equal(got_bf16.view(np.uint16), got.astype(BF16).view(np.uint16))
    # float32 summation's bound on the operands as the product reads them (bf16: rounded)
    k = w_shape[0] if kind in ("matmul", "rows") else int(np.prod(w_shape[1:]))
    rounded = [v.astype(BF16).astype(np.float64) if precision == "bf16" else v for v in (x, w)]
    bound = 2 * k * U / (1 - k * U) * k * np.abs(rounded[0]).max() * np.abs(rounded[1]).max()
    assert np.abs(got - want).max() <= bound + 4 * U * np.abs(want).max()


def test_sums_only_the_epilogue_reads_stay_in_a_scratch():
    """The cast tail makes the product's sums private: a scratch of whole 64-byte rows
    for a chunk of them; a float32 result written in place is the output itself."""
    _, w_shape, _ = CASES["matmul"]
    w = np.ones(w_shape, np.float32)
    private, _ = _product(_residual_block("matmul", w, "bf16"))
    g = private.gemm()
    assert g.private_c
    rows, stride = gemm_llvm.scratch_c(g)
    assert stride % 16 == 0 and stride >= 16 and rows <= CASES["matmul"][0][0]
    in_place, _ = _product(_residual_block("matmul", w, "bf16", cast=False))
    assert not in_place.gemm().private_c and gemm_llvm.scratch_c(in_place.gemm()) is None



@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("kind", ["conv", "matmul"])
def test_c_rendering_of_two_stores(kind, tmp_path):
    """The C rendering writes both stores of the fused tail, as the JIT does (the weight
    an input: the region reads it as it lies)."""
    rng = np.random.default_rng(5)
    x_shape, w_shape, r_shape = CASES[kind]

    def body(bb, x, w, r):
        op = R.nn.conv2d(x, w, padding=1) if kind == "conv" else R.matmul(x, w)
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(op), r))))
        return [y, bb.emit(R.astype(y, "bfloat16"))]
    mod = build_model({"x": (x_shape, "float32"), "w": (w_shape, "float32"), "r": (r_shape, "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    assert len(region.kernel.stages[-1].epilogue_also) == 1
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    x, w, r = (rng.standard_normal(s).astype(np.float32) for s in (x_shape, w_shape, r_shape))
    args = [{"x": x, "w": w, "r": r}[name] for name in region.arg_names[:len(region.kernel.inputs)]]
    (got, got_bf16), (want, _) = call_region(c_fn, region.kernel, args), call_region(jit_fn, region.kernel, args)
    assert np.array_equal(got_bf16.view(np.uint16), got.astype(BF16).view(np.uint16))
    k = int(np.prod(w_shape[1:])) if kind == "conv" else w_shape[0]
    bound = 2 * k * U / (1 - k * U) * k * np.abs(x).max() * np.abs(w).max()
    assert np.abs(got - want).max() <= bound

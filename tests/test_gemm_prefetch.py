"""A product whose A is a weight streams it (:attr:`jitbyoc.engines.gemm.Gemm.stream_a`):
the GEMM engine prefetches the next row tile's rows of A while a tile computes. A
pointwise convolution's weight is such an A; a matmul's A (activations) is not, and
prefetching it cost BERT 5 %."""

import re

import numpy as np
import tvm
from tvm.script import relax as R

import jitbyoc
from jitbyoc.engines import gemm_engine, ir_text, registry
from jitbyoc.engines.gemm_engine import GemmEngine
from jitbyoc.render import isa
from tests.diff_util import build, run


@R.function
def _conv_and_matmul(x: R.Tensor((1, 64, 14, 14), "float32"), w: R.Tensor((200, 64, 1, 1), "float32"),
                     a: R.Tensor((32, 64), "float32"), b: R.Tensor((64, 96), "float32")):
    with R.dataflow():
        y = R.nn.conv2d(x, w)
        z = R.matmul(a, b)
        R.output(y, z)
    return (y, z)


_MODULE = tvm.IRModule({"main": _conv_and_matmul.with_attr("global_symbol", "main")})


def _stream_flags(monkeypatch) -> dict[str, list[int]]:
    """Per region (by its first op), the stream flags its calls of the GEMM engine pass
    (the last slot)."""
    seen, calls = [], registry.call

    def spy(ctx, engine, slots):
        if isinstance(engine, GemmEngine):
            seen.append(int(slots[-1].constant))
        return calls(ctx, engine, slots)
    monkeypatch.setattr(gemm_engine.registry, "call", spy)
    flags = {}
    for region in jitbyoc.inspect(_MODULE):
        seen.clear()
        region.llvm_ir  # noqa: B018
        flags[region.symbol.split("_")[1]] = list(seen)
    return flags


def test_a_pointwise_convs_weight_is_streamed_and_a_matmuls_activations_are_not(monkeypatch):
    assert _stream_flags(monkeypatch) == {"nn": [1], "matmul": [0]}


# a prefetch for reading into L2 (llvm.prefetch: read, locality 2, data), in an engine's IR
READ_INTO_L2 = r"call void @\"?llvm.prefetch.p0\"?\(ptr [^,]+, i32 0, i32 2, i32 1\)"


def test_the_engine_reads_ahead_in_a():
    """Reads into L2 (the engine's other prefetches are the C tile's, for writing)."""
    assert re.search(READ_INTO_L2, ir_text(GemmEngine("float32", 4, "k", "x"), isa.current().triple, ""))


def test_streamed_products_agree_with_tvm_at_every_row_tile():
    """200 output channels: 33 tiles of 6 rows and 2 of 5, the last tiles' prefetches
    reach past the weight's end (harmless: a prefetch never faults)."""
    rng = np.random.default_rng(0)
    shapes = [(1, 64, 14, 14), (200, 64, 1, 1), (32, 64), (64, 96)]
    args = [rng.standard_normal(s).astype("float32") for s in shapes]
    got, ref = run(build(_MODULE, True), args), run(build(_MODULE, False), args)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

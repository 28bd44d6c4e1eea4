"""Build-time rewrites of linear layers with constant weights (jitbyoc/tvm/linear.py):
the weight packed into the GEMM engine's column panels, and a projection split into
attention heads done as one batched product. Each is checked for what it changes in the
region (inputs, stages, engine) and differentially: numpy and TVM's default build, on
this machine's ISA and on AVX2 (16-column panels)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.engines.gemm import panel_width
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, build_tvm, run

RNG = np.random.default_rng(7)


def _target(cpu):
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu} if cpu else "llvm")


def _width(machine) -> int:
    with isa.compiling_for(machine):
        return panel_width("float32")


def _check(mod, target, x, want):
    """jitbyoc's build for ``target`` against numpy's ``want`` and TVM's default build."""
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ref = run(build_tvm(mod), x)
    assert float(np.max(np.abs(got - ref))) <= 1e-4 * max(float(np.max(np.abs(ref))), 1.0)


def _region(mod, machine):
    """The one region of ``mod``, lowered for ``machine``: (input shapes, stage kinds, engines)."""
    with isa.compiling_for(machine):
        (region,) = jitbyoc.inspect(mod)
        return ([tuple(b.shape) for b in region.kernel.inputs], [type(s).__name__ for s in region.kernel.stages],
                region.engines)


@pytest.mark.parametrize("cpu,form,rows,k", [(None, "linear", (5,), 40), (None, "matmul", (2, 3), 800),
                                             ("haswell", "linear", (7,), 800), ("haswell", "matmul", (3,), 40)])
def test_a_constant_weight_is_packed_into_the_gemm_engines_panels_at_build_time(cpu, form, rows, k):
    """A constant weight of a product of several rows (torch's linear, W.T, or a plain
    K x N constant) is packed once into the engine's column panels (64 float32 columns
    with AVX-512, 16 with AVX2): the region takes P (N/w, K, w), runs no permute, and the
    engine reads the panels in place (its "p" variant), K blocks (K > 384) included."""
    target = _target(cpu)
    machine = machine_for(target)
    width = _width(machine)
    n = 3 * width
    w = RNG.standard_normal((n, k) if form == "linear" else (k, n)).astype("float32")
    bias = RNG.standard_normal(n).astype("float32")

    def body(bb, x):
        weight = relax.op.permute_dims(relax.const(w), [1, 0]) if form == "linear" else relax.const(w)
        y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, bb.emit(weight))), relax.const(bias)))
        return bb.emit(relax.op.nn.relu(y))

    mod = build_model({"x": (rows + (k,), "float32")}, body)
    inputs, stages, engines = _region(mod, machine)
    assert (n // width, k, width) in inputs and stages == ["MatMul"], (inputs, stages)
    assert any(e.endswith("_p") for e in engines), engines
    x = RNG.standard_normal(rows + (k,)).astype("float32")
    _check(mod, target, x, np.maximum(x @ (w.T if form == "linear" else w) + bias, 0))


def test_a_weight_whose_columns_do_not_fill_panels_is_only_transposed_once():
    """N not a multiple of the panel width: torch's W.T is made row-major once (no
    permute per call), as before panels."""
    w = RNG.standard_normal((24, 40)).astype("float32")

    def body(bb, x):
        return bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w), [1, 0]))))

    mod = build_model({"x": ((5, 40), "float32")}, body)
    inputs, stages, _ = _region(mod, isa.host())
    assert (40, 24) in inputs and stages == ["MatMul"], (inputs, stages)
    x = RNG.standard_normal((5, 40)).astype("float32")
    _check(mod, "llvm", x, x @ w.T)


# (x rows, reshape, permute axes): BERT's Q/K/V (2-D x, one batch item), a batch of 2,
# ViT's fused QKV (three groups, then heads), and a head size that is not a panel width
SPLITS = [((128,), (1, 128, 12, 64), (0, 2, 1, 3)), ((2, 9), (2, 9, 4, 32), (0, 2, 1, 3)),
          ((1, 11), (1, 11, 3, 4, 32), (2, 0, 3, 1, 4)), ((7,), (1, 7, 3, 24), (0, 2, 1, 3))]


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("rows,split,axes", SPLITS)
def test_a_projection_split_into_heads_is_one_batched_product(cpu, rows, split, axes):
    """``permute_dims(reshape(x @ W.T + b, (B, M, G..., D)), axes)`` (attention's Q, K, V)
    becomes one product per head with W and b rearranged at build time: the region has a
    single matmul stage (no permute copying its output) whose weight is one block per head,
    in panels when D is a multiple of the panel width (one panel wide: the row-major block
    is that panel, and the panel engine reads it)."""
    target = _target(cpu)
    machine = machine_for(target)
    k, n = 48, int(np.prod(split[2:]))
    w, bias = RNG.standard_normal((n, k)).astype("float32"), RNG.standard_normal(n).astype("float32")

    def body(bb, x):
        y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w), [1, 0]))))
        y = bb.emit(relax.op.add(relax.const(bias), y))
        return bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(y, split)), axes))

    mod = build_model({"x": (rows + (k,), "float32")}, body)
    _, stages, engines = _region(mod, machine)
    assert stages == ["MatMul"], stages
    width, d = _width(machine), split[-1]
    assert any(e.endswith("_p") for e in engines) == (d % width == 0), engines
    x = RNG.standard_normal(rows + (k,)).astype("float32")
    _check(mod, target, x, np.transpose((x @ w.T + bias).reshape(split), axes))


def test_a_head_split_whose_projection_is_used_elsewhere_stays_as_it_is():
    """The projection also feeds another op: splitting it would compute it twice."""
    w = RNG.standard_normal((64, 16)).astype("float32")

    def body(bb, x):
        y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w), [1, 0]))))
        heads = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(y, (1, 6, 2, 32))), [0, 2, 1, 3]))
        return [heads, bb.emit(relax.op.nn.relu(y))]

    mod = build_model({"x": ((6, 16), "float32")}, body)
    _, stages, _ = _region(mod, isa.host())
    assert "Permute" in stages, stages
    x = RNG.standard_normal((6, 16)).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x)
    np.testing.assert_allclose(got[0], np.transpose((x @ w.T).reshape(1, 6, 2, 32), (0, 2, 1, 3)), rtol=1e-5, atol=1e-5)


def fused_qkv(k: int, heads: int, d: int, m: int):
    """ViT's attention input: one linear to 3 x hidden, split into (3, 1, heads, M, D),
    then Q, K and V sliced off and squeezed. ``(module, W, bias)``."""
    w = RNG.standard_normal((3 * heads * d, k)).astype("float32")
    bias = RNG.standard_normal(3 * heads * d).astype("float32")

    def body(bb, x):
        y = bb.emit(relax.op.linear(x, relax.const(w), relax.const(bias)))
        qkv = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(y, (1, m, 3, heads, d))), [2, 0, 3, 1, 4]))
        return [bb.emit(relax.op.squeeze(bb.emit(relax.op.strided_slice(qkv, [0], [i], [i + 1])), [0]))
                for i in range(3)]

    return build_model({"x": ((1, m, k), "float32")}, body), w, bias


def test_a_fused_qkv_sliced_into_q_k_v_is_one_product_per_piece():
    """ViT's attention (:func:`fused_qkv`): each slice becomes the product of its own
    weights, written straight into its output (its bias add fused, the squeeze then
    free): no slice, no permute."""
    k, heads, d, m = 48, 2, 32, 11
    mod, w, bias = fused_qkv(k, heads, d, m)
    with isa.compiling_for(isa.host()):
        stages = [type(s).__name__ for r in jitbyoc.inspect(mod) for s in r.kernel.stages]
    # each piece's product writes its output (no slice, no permute); the partitioner may
    # hand x's reshape out of one piece's region to the others (an Elementwise copy)
    assert stages.count("MatMul") >= 1 and set(stages) <= {"MatMul", "Elementwise"}, stages
    x = RNG.standard_normal((1, m, k)).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x)
    want = np.transpose((x @ w.T + bias).reshape(1, m, 3, heads, d), (2, 0, 3, 1, 4))
    ref = run(build_tvm(mod), x)
    for i in range(3):
        np.testing.assert_allclose(got[i], want[i], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-5, atol=1e-5)


def test_a_fused_qkv_in_the_bf16_mode_is_one_product_per_piece_too():
    """The same in :func:`jitbyoc.lower_precision`'s bf16 mode, whose weights are packed
    in panels of bfloat16 pairs (``..., N/w, K/2, w, 2``): the head split and the slices
    did not recognize that packing, so ViT's bf16 product wrote the whole fused QKV and
    copied it into heads (a permute, then slices). Within the bf16 bound of numpy's
    product of the rounded operands, and near TVM's build of the same lowered model."""
    import ml_dtypes

    k, heads, d, m = 48, 2, 64, 11  # heads of 64 columns: whole panels of vdpbf16ps (64) and AMX (32)
    mod, w, bias = fused_qkv(k, heads, d, m)
    mod = jitbyoc.lower_precision(mod, "bf16")
    with isa.compiling_for(isa.host()):
        stages = [type(s).__name__ for r in jitbyoc.inspect(mod) for s in r.kernel.stages]
    assert "Permute" not in stages and "Slice" not in stages and "MatMul" in stages, stages
    x = RNG.standard_normal((1, m, k)).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x)
    bf = ml_dtypes.bfloat16
    xr, wr = (a.astype(bf).astype(np.float64) for a in (x, w))
    want = np.transpose((xr @ wr.T + bias).reshape(1, m, 3, heads, d), (2, 0, 3, 1, 4))
    bound = np.transpose((np.abs(xr) @ np.abs(wr.T)).reshape(1, m, 3, heads, d), (2, 0, 3, 1, 4)) * k * 2.0 ** -23
    ref = run(build_tvm(mod), x)
    for i in range(3):
        assert (np.abs(got[i] - want[i]) <= bound[i] + 1e-6).all()
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-4, atol=1e-4)


def test_a_slice_of_a_product_used_elsewhere_too_is_left_to_the_slice():
    """The split product also feeds another op: slicing its weights would compute the
    pieces twice, so the slice stays a slice."""
    k, d, m = 16, 32, 5
    w = RNG.standard_normal((2 * d, k)).astype("float32")

    def body(bb, x):
        y = bb.emit(relax.op.linear(x, relax.const(w)))
        halves = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(y, (1, m, 2, d))), [2, 0, 1, 3]))
        return [bb.emit(relax.op.strided_slice(halves, [0], [1], [2])), bb.emit(relax.op.nn.relu(halves))]

    mod = build_model({"x": ((1, m, k), "float32")}, body)
    with isa.compiling_for(isa.host()):
        stages = [type(s).__name__ for r in jitbyoc.inspect(mod) for s in r.kernel.stages]
    assert stages.count("MatMul") == 1, stages
    x = RNG.standard_normal((1, m, k)).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x)
    halves = np.transpose((x @ w.T).reshape(1, m, 2, d), (2, 0, 1, 3))
    np.testing.assert_allclose(got[0], halves[1:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], np.maximum(halves, 0), rtol=1e-5, atol=1e-5)


def test_a_slice_of_a_product_plus_a_computed_tensor_keeps_the_sum():
    """``(x @ W + y)[1:2]`` with ``y`` an input: the slice of the product alone dropped
    ``+ y`` (only a constant bias is sliced along with the weights). Found by a review
    helper; ONNX: MatMul by a 3-D constant, Add of a graph input, Slice."""
    w = RNG.standard_normal((3, 8, 4)).astype("float32")

    def body(bb, x, y):
        q = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), y))
        return bb.emit(relax.op.strided_slice(q, axes=[0], begin=[1], end=[2]))

    mod = build_model({"x": ((1, 5, 8), "float32"), "y": ((3, 5, 4), "float32")}, body)
    x, y = RNG.standard_normal((1, 5, 8)).astype("float32"), RNG.standard_normal((3, 5, 4)).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x, y)
    np.testing.assert_allclose(got, (x @ w + y)[1:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, run(build_tvm(mod), x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("after", ["squeeze", "reshape"])
def test_a_product_with_a_fused_bias_writes_a_reshaped_output_directly(after):
    """A bias add fused into the product, then a squeeze or reshape as the region's
    output: the product writes the output (a view of it), no copy stage after it."""
    w, bias = RNG.standard_normal((40, 24)).astype("float32"), RNG.standard_normal(24).astype("float32")

    def body(bb, x):
        y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(bias)))
        return bb.emit(relax.op.squeeze(y, [0]) if after == "squeeze" else relax.op.reshape(y, (6, 4, 24)))

    mod = build_model({"x": ((1, 24, 40), "float32")}, body)
    _, stages, _ = _region(mod, isa.host())
    assert stages == ["MatMul"], stages
    x = RNG.standard_normal((1, 24, 40)).astype("float32")
    want = (x @ w + bias).reshape((24, 24) if after == "squeeze" else (6, 4, 24))
    _check(mod, "llvm", x, want)


@pytest.mark.parametrize("cpu", [None, "haswell"])
def test_a_float64_weight_is_packed_in_its_own_panel_width(cpu):
    """float64's register tile is narrower (16 columns with AVX-512, 8 with AVX2): its
    panels follow it."""
    target = _target(cpu)
    machine = machine_for(target)
    with isa.compiling_for(machine):
        width = panel_width("float64")
    k, n = 30, 4 * width
    w = RNG.standard_normal((n, k))

    def body(bb, x):
        return bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w, "float64"), [1, 0]))))

    mod = build_model({"x": ((9, k), "float64")}, body)
    inputs, stages, _ = _region(mod, machine)
    assert (n // width, k, width) in inputs and stages == ["MatMul"], (inputs, stages)
    x = RNG.standard_normal((9, k))
    _check(mod, target, x, x @ w.T)


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("rows", [5, "m"])
def test_a_row_major_b_one_panel_wide_runs_on_the_panel_engine(cpu, rows):
    """A B of exactly one panel's width with contiguous rows has the panel layout: a static
    stack of rows reads it on the panel engine (a model needs no in-place engine besides);
    a symbolic row count keeps the in-place engine, whose GEMV serves one row."""
    target = _target(cpu)
    machine = machine_for(target)
    n, k = _width(machine), 40
    mod = build_model({"x": ((rows, k), "float32"), "w": ((k, n), "float32")},
                      lambda bb, x, w: bb.emit(relax.op.matmul(x, w)))
    _, _, engines = _region(mod, machine)
    unit = sorted(e.rsplit("_", 1)[1] for e in engines if "_gemm_" in e)
    assert unit == (["p"] if rows == 5 else ["x"]), engines
    for m in ([5] if rows == 5 else [1, 3]):
        x, w = RNG.standard_normal((m, k)).astype("float32"), RNG.standard_normal((k, n)).astype("float32")
        with jitbyoc.enabled():
            got = run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), x, w)
        np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, run(build_tvm(mod), x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("m,n,packed", [(512, 2050, True), (511, 2048, False), (512, 2047, False)])
def test_a_b_with_rows_8_kb_apart_is_packed_for_a_tall_product(cpu, m, n, packed):
    """A row-major B whose rows are 8 KB or more apart, multiplied by 512 rows or more, is
    packed rather than read in place (the engine's "xp" unit; sgemm 2048^3 3 % faster);
    shorter stacks and narrower B keep reading it in place. Edges of N included."""
    target = _target(cpu)
    machine = machine_for(target)
    k = 9
    mod = build_model({"x": ((m, k), "float32"), "w": ((k, n), "float32")},
                      lambda bb, x, w: bb.emit(relax.op.matmul(x, w)))
    _, _, engines = _region(mod, machine)
    unit = [e.rsplit("_", 1)[1] for e in engines if "_gemm_" in e]
    assert unit == (["xp"] if packed else ["x"]), engines
    x, w = RNG.standard_normal((m, k)).astype("float32"), RNG.standard_normal((k, n)).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), x, w)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)

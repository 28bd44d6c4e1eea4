"""Differential tests of the matmul kernel (jitbyoc/kernels/matmul.py, on kernels/gemm.py).

Each test puts a grid of independent cases into ONE model, so one TVM build and one
jitbyoc build cover it. Every output is compared with TVM's default build and with numpy
(``MatMul.reference``) within the bound documented in matmul.py:
``2 * gamma_K * (|A| @ |B|)`` (two summation orders, each within ``gamma_K`` of exact).
"""

import dataclasses
import shutil
import subprocess

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import cache
from jitbyoc.engines.gemm import Operand
from jitbyoc.kernels.matmul import MatMul

CC = shutil.which("cc")
ACTS = {"relu": relax.op.nn.relu, "gelu": relax.op.nn.gelu, "silu": relax.op.nn.silu,
        "sigmoid": relax.op.sigmoid, "tanh": relax.op.tanh}
NUMPY_ACTS = {"relu": lambda x: np.maximum(x, 0), "tanh": np.tanh,
              "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "silu": lambda x: x / (1 + np.exp(-x)),
              "gelu": lambda x: 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))}


# ---- models ------------------------------------------------------------------------------------

def case(a, b, dtype="float32", perm_a=None, perm_b=None, bias=None, act=None, linear=False):
    """One matmul case: operand shapes (before any permute), and what follows it."""
    return dict(a=a, b=b, dtype=dtype, perm_a=perm_a, perm_b=perm_b, bias=bias, act=act, linear=linear)


def model(cases, sym=()):
    names = {s: tvm.tirx.Var(s, "int64") for s in sym}
    bb = relax.BlockBuilder()
    params, emitted = [], []
    for k, c in enumerate(cases):
        shapes = [c["a"], c["b"]] + ([c["bias"]] if c["bias"] else [])
        vs = [relax.Var(f"c{k}_{i}", relax.TensorType([names.get(d, d) for d in s], c["dtype"]))
              for i, s in enumerate(shapes)]
        params += vs
        emitted.append((c, vs))
    with bb.function("main", params):
        with bb.dataflow():
            outs = []
            for c, vs in emitted:
                x, w = vs[0], vs[1]
                if c["linear"]:  # the frontends' linear: permute_dims(w) + matmul (+ bias)
                    y = bb.emit(relax.op.linear(x, w, vs[2] if c["bias"] else None))
                else:
                    if c["perm_a"]:
                        x = bb.emit(relax.op.permute_dims(x, c["perm_a"]))
                    if c["perm_b"]:
                        w = bb.emit(relax.op.permute_dims(w, c["perm_b"]))
                    y = bb.emit(relax.op.matmul(x, w))
                    if c["bias"]:
                        y = bb.emit(relax.op.add(y, vs[2]))
                if c["act"]:
                    y = bb.emit(ACTS[c["act"]](y))
                outs.append(y)
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(out)
    return bb.get()


def arrays(cases, sizes=None, seed=0):
    rng, out = np.random.default_rng(seed), []
    for c in cases:
        for s in [c["a"], c["b"]] + ([c["bias"]] if c["bias"] else []):
            out.append(rng.standard_normal([(sizes or {}).get(d, d) for d in s]).astype(c["dtype"]))
    return out


def build(mod, offload):
    with (jitbyoc.enabled() if offload else jitbyoc.disabled()):
        return tvm.compile(mod, target="llvm")


def run(ex, args):
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]


# ---- the bound ---------------------------------------------------------------------------------

def operands(c, a, b):
    """The operands as the matmul sees them (after permutes)."""
    if c["linear"]:
        return a, np.swapaxes(b, -1, -2) if b.ndim > 1 else b
    return (np.transpose(a, c["perm_a"]) if c["perm_a"] else a,
            np.transpose(b, c["perm_b"]) if c["perm_b"] else b)


def bound(c, x, w, ref):
    """``2 gamma_K |A||B|``, then the bias add's rounding and the activation's own error
    (Lipschitz constant <= 1.13 for these activations; table ulp bound, with an absolute
    floor of one ulp of 1 for results that underflow relatively)."""
    eps = np.finfo(c["dtype"]).eps
    k = x.shape[-1]
    u = eps / 2
    gamma = k * u / (1 - k * u)
    pre = 2 * gamma * np.matmul(np.abs(x).astype("float64"), np.abs(w).astype("float64"))
    if c["bias"]:
        pre = pre + 2 * u * (np.abs(np.matmul(x.astype("float64"), w.astype("float64"))) + 1)
    if c["act"] in (None, "relu"):
        return pre + 4 * np.finfo(c["dtype"]).tiny
    return 1.13 * pre + 16 * eps * (np.abs(ref) + 1e-3)


def check(cases, args, outs, refs):
    k = 0
    for c, got, ref in zip(cases, outs, refs):
        n = 3 if c["bias"] else 2
        a, b = args[k:k + n][:2]
        bias = args[k + 2] if c["bias"] else None
        k += n
        x, w = operands(c, a, b)
        npref = MatMul.reference(x.astype("float64"), w.astype("float64"))
        if bias is not None:
            npref = npref + bias
        if c["act"]:
            npref = NUMPY_ACTS[c["act"]](npref)
        tol = bound(c, x, w, npref)
        assert got.shape == ref.shape == npref.shape, (c, got.shape, ref.shape)
        for name, other in (("TVM", ref), ("numpy", npref)):
            err = np.abs(got.astype("float64") - other)
            assert np.all(err <= tol), f"{c} vs {name}: max err {err.max()}, worst ratio {np.max(err / tol)}"


def offload_whole(mod):
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [], str(rep)
    return rep


def differential(cases, sizes=None, sym=()):
    mod = model(cases, sym)
    offload_whole(mod)
    jit_ex, tvm_ex = build(mod, True), build(mod, False)
    for seed, values in enumerate([sizes] if not isinstance(sizes, list) else sizes):
        args = arrays(cases, values, seed)
        check(cases, args, run(jit_ex, args), run(tvm_ex, args))
    return mod


# ---- tests -------------------------------------------------------------------------------------

SHAPES_2D = [(1, 1, 1), (1, 17, 3), (3, 5, 7), (17, 33, 127), (127, 129, 17), (129, 385, 130),
             (6, 64, 64), (13, 800, 65), (1, 300, 129), (200, 16, 1), (64, 784, 10)]


def test_2d_grid_awkward_sizes():
    """Sizes around 1, the vector width (16), MR, NR and KC (a K of 385 and 800 spans
    several K blocks)."""
    differential([case((m, k), (k, n)) for m, k, n in SHAPES_2D])


def test_rows_in_tiles_one_row_short():
    """Rows that leave each remainder 1..5 by the 6-row tile run their last tiles one row
    short (gemm_llvm.row_tiles); 13 rows are too few for that (plain edge). Static rows
    (inline driver, constant weights) and symbolic ones (library engine), with an N edge
    and a fused epilogue."""
    rows = [13, 25, 128, 129, 130, 131, 197]
    differential([case((m, 96), (96, 70), bias=(70,), act="relu") for m in rows]
                 + [case((m, 40), (130, 40), linear=True) for m in rows[:3]])
    differential([case(("n", 96), (96, 70), bias=(70,), act="relu")],
                 sizes=[{"n": m} for m in rows], sym=("n",))


BATCHED = [((2, 17, 33), (2, 33, 40)), ((2, 17, 33), (33, 40)), ((1, 17, 33), (3, 33, 40)),
           ((3, 17, 33), (1, 33, 40)), ((2, 3, 17, 33), (3, 33, 40)), ((2, 1, 5, 33), (1, 4, 33, 7)),
           ((4, 5, 6), (6,)), ((6,), (2, 6, 9)), ((33,), (33,)), ((17, 33), (33,)), ((5, 1, 3), (3, 2))]


def test_batched_broadcast_and_1d_forms():
    differential([case(a, b) for a, b in BATCHED])


TRANSPOSED = [case((17, 130), (129, 130), perm_b=[1, 0]),
              case((130, 17), (130, 129), perm_a=[1, 0]),
              case((130, 17), (129, 130), perm_a=[1, 0], perm_b=[1, 0]),
              case((2, 3, 17, 64), (2, 3, 20, 64), perm_b=[0, 1, 3, 2]),  # attention's Q K^T
              case((2, 17, 64), (20, 2, 64), perm_b=[1, 2, 0]),
              case((3, 33), (40, 33), linear=True)]


def stages(mod) -> list:
    """Every kernel stage of every region (one region per matmul: one heavy kernel each)."""
    return [s for region in jitbyoc.inspect(mod) for s in region.kernel.stages]


def test_transposed_operands_are_read_in_place():
    mod = differential(TRANSPOSED)
    matmuls = [s for s in stages(mod) if isinstance(s, MatMul)]
    assert len(matmuls) == len(TRANSPOSED)
    assert all(s.perms != (None, None) for s in matmuls), "every permute must be folded"
    assert not any(type(s).__name__ == "Permute" for s in stages(mod))


def test_linear_bias_activation_fused():
    """Every activation after linear (2-D, and 3-D whose batch folds into rows) and after
    a batched matmul with a broadcast bias; each must end up in its matmul's epilogue."""
    cases = []
    for j, act in enumerate(sorted(ACTS)):  # distinct N per case: no output shares a nest
        cases += [case((64, 100), (129 + j, 100), bias=(129 + j,), act=act, linear=True),
                  case((2, 17, 100), (33 + j, 100), bias=(33 + j,), act=act, linear=True),
                  case((3, 5, 7), (3, 7, 9 + j), bias=(5, 9 + j), act=act)]
    mod = differential(cases)
    assert [type(s).__name__ for s in stages(mod)] == ["MatMul"] * len(cases)
    assert all(s.epilogue is not None for s in stages(mod))


def test_a_batched_product_with_a_1d_right_operand_applies_its_epilogue_everywhere():
    """``(*batch, M, K) @ (K,)`` then an activation or a bias add: the tall product for a B
    shared by the batch gave its row epilogue ``(*batch, N)`` rows, dropping M, so relu
    reached one column only and a bias was read at the wrong places. Found by a review
    helper's fuzzer."""
    cases = [case((2, 4, 8), (8,), act="relu"), case((1, 17, 3), (3,), bias=(17,)),
             case((3, 2, 5, 70), (70,), bias=(5,), act="gelu")]
    mod = differential(cases)
    assert all(s.epilogue is not None for s in stages(mod))


def test_symbolic_rows_and_batch_read_at_run_time():
    cases = [case(("n", 33), (33, 40), bias=(40,), act="relu"),
             case(("n", 5, 33), (33, 17)),
             case((2, "n", 33), (2, 33, 17)),
             case(("n", 70), (90, 70), linear=True)]
    differential(cases, sizes=[{"n": 1}, {"n": 130}], sym=("n",))


def test_symbolic_reduction_and_columns():
    cases = [case(("n", "s"), ("s", 70), bias=(70,), act="relu"), case((3, "s"), ("s", "n")),
             case(("s",), ("s", "n")), case(("n", 33, "s"), ("n", "s", 5))]
    mod = differential(cases, sizes=[{"n": 1, "s": 1}, {"n": 67, "s": 130}], sym=("n", "s"))
    # K = 0 at run time: the sum is empty, so the product is 0 (+ bias). Checked against
    # numpy only: TVM's default build leaves the output uninitialized for an empty
    # symbolic reduction (its init sits inside the k loop).
    args = arrays(cases, {"n": 3, "s": 0})
    got = run(build(mod, True), args)
    np.testing.assert_array_equal(got[0], np.maximum(np.broadcast_to(args[2], (3, 70)), 0))
    assert all(not g.any() for g in got[1:])


def test_float64():
    differential([case((m, k), (k, n), dtype="float64") for m, k, n in SHAPES_2D[:6]]
                 + [case((2, 17, 33), (40, 33), dtype="float64", bias=(40,), act="sigmoid", linear=True)])


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 150), k=st.integers(1, 500), n=st.integers(1, 150), fused=st.booleans())
def test_random_sizes(m, k, n, fused):
    differential([case((m, k), (k, n), bias=(n,) if fused else None, act="relu" if fused else None)])


class Packed(Operand):
    """An operand without ``direct_llvm``: the engine must pack it (as it packs a conv's
    im2col), through the wrapped operand's own packers."""

    def __init__(self, inner):
        self.inner, self.dtype = inner, inner.dtype

    def element_llvm(self, ctx, b, x, k):
        return self.inner.element_llvm(ctx, b, x, k)

    def element_c(self, ctx, b, x, k):
        return self.inner.element_c(ctx, b, x, k)

    def pack_llvm(self, *args):
        self.inner.pack_llvm(*args)


class ByElement(Packed):
    """Packed element by element: the default ``Operand.pack_llvm`` a custom operand gets."""
    pack_llvm = Operand.pack_llvm


@pytest.mark.parametrize("wrap", [Packed, ByElement])
def test_engine_packs_operands_it_cannot_read_in_place(wrap, monkeypatch):
    """The GEMM engine's paths for operands other than matmul's (conv reuses them): A
    packed into MR panels, B packed into NR panels, row copies, transposes and the scalar
    default, at edges, batched, with an epilogue. Shapes are unique to this test, so no
    cached build of the usual path can stand in for the patched one."""
    build_gemm = MatMul.gemm
    monkeypatch.setattr(MatMul, "gemm", lambda self: dataclasses.replace(
        build_gemm(self), a=wrap(build_gemm(self).a), b=wrap(build_gemm(self).b)))
    cache.clear_memory()
    try:
        differential([case((23, 397), (397, 71)), case((397, 23), (397, 71), perm_a=[1, 0]),
                      case((3, 23, 41), (3, 71, 41), perm_b=[0, 2, 1], bias=(23, 71), act="relu"),
                      case((7,), (7, 5)), case((2, 1, 5, 9), (3, 9, 11))])
    finally:
        cache.clear_memory()


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_agrees_with_llvm(tmp_path):
    cases = [case((17, 129), (129, 33)), case((2, 17, 33), (40, 33), bias=(40,), act="gelu", linear=True),
             case((1, 5, 33), (3, 33, 7), bias=(5, 7), act="relu"), case((33,), (2, 33, 5)),
             case((130, 17), (129, 130), perm_a=[1, 0], perm_b=[1, 0])]
    mod = model(cases)
    args = arrays(cases)
    by_name = dict(zip([p.name for p in mod["main"].params], args))
    got_c = [None] * len(cases)
    for k, region in enumerate(jitbyoc.inspect(mod)):  # one region per case, named c<case>_<i>
        src, lib = tmp_path / f"mm{k}.c", tmp_path / f"mm{k}.so"
        src.write_text(region.c_source)
        subprocess.run([CC, "-O2", "-ffp-contract=off", "-shared", "-fPIC", str(src), "-o", str(lib)],
                       check=True, capture_output=True)
        (out,) = [tvm.runtime.empty([int(d) for d in b.shape], b.dtype) for b in region.kernel.outputs]
        names = region.arg_names[:len(region.kernel.inputs)]
        tvm.runtime.load_module(str(lib))[region.symbol](*[tvm.runtime.tensor(by_name[n]) for n in names], out)
        got_c[int(names[0].split("_")[0][1:])] = out.numpy()
    check(cases, args, got_c, run(build(mod, True), args))  # C vs LLVM (and numpy)
    check(cases, args, got_c, run(build(mod, False), args))  # C vs TVM


@pytest.mark.parametrize("dtypes, reason", [
    (("int32", "int32", None), "no product int32 x int32 -> int32"),
    (("int16", "int16", "int32"), "dtype int16 not supported"),
    (("uint8", "uint8", "int32"), "no product uint8 x uint8 -> int32"),
    (("float32", "float32", "float64"), "no product float32 x float32 -> float64"),
    (("bfloat16", "float32", "float32"), "no product bfloat16 x float32 -> float32"),
])
def test_unsupported_stays_with_tvm_with_reason(dtypes, reason):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((4, 8), dtypes[0]))
    b = relax.Var("b", relax.TensorType((8, 3), dtypes[1]))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b, out_dtype=dtypes[2]))
        bb.emit_func_output(out)
    rep = jitbyoc.report(bb.get())
    assert [f.op for f in rep.fallbacks] == ["relax.matmul"]
    assert reason in rep.fallbacks[0].reason


def test_single_row_products_take_the_gemv_paths():
    """One row of A (static, or a symbolic row count that is 1 at run time) against B
    read along k (``linear``: the row-dot GEMV) or along n (``x @ W``: the column GEMV),
    sizes around the vector width and the 4-row / 4-vector blocks, epilogues fused."""
    cases = []
    for j, (k, n) in enumerate([(1, 1), (17, 3), (64, 4), (65, 5), (300, 129), (16, 63), (33, 70)]):
        cases += [case((1, k), (n, k), bias=(n,), act="relu", linear=True),
                  case(("m", k), (k, n), bias=(n,), act="tanh"),
                  case((1, 1, k), (n, k), linear=True),
                  case((1, k), (k, n + 64), dtype="float64")]
    differential(cases, sizes=[{"m": 1}, {"m": 3}], sym=("m",))


def test_a_transpose_read_through_a_reshape_dropping_unit_dims_is_read_in_place():
    """Attention's K^T as torch.export gives it: ``permute_dims(k, [0, 1, 3, 2])`` of a
    ``(1, H, S, D)`` key, reshaped to ``(H, D, S)`` for a batched product. The product
    reads ``k`` in place (no permute copies it)."""
    from tests.conftest import build_both, build_model

    h, s, d = 3, 19, 16

    def body(bb, q, k):
        kt = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2])), (h, d, s)))
        return bb.emit(relax.op.matmul(bb.emit(relax.op.reshape(q, (h, s, d))), kt))

    mod = build_model({"q": ((1, h, s, d), "float32"), "k": ((1, h, s, d), "float32")}, body)
    kinds = [type(st).__name__ for st in stages(mod)]
    assert kinds == ["MatMul"], kinds
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal((1, h, s, d)).astype("float32") for _ in range(2))
    want, got = build_both(mod).run(q, k)
    np.testing.assert_allclose(got, q[0] @ np.swapaxes(k[0], -1, -2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("low", [False, True], ids=["float32", "bf16"])
def test_an_activation_after_a_reshape_joins_the_bias_add_in_the_epilogue(low):
    """BERT's and ViT's FFN as torch.export gives it: ``linear + add``, a reshape, then
    GELU (and, in the bf16 mode, the cast of its result to the next product's bfloat16).
    The bias add fused into the product first; the GELU then stayed a pass of its own over
    the float32 result, since a fused epilogue was final. Now the product applies both on
    its blocks (one stage), with TVM's results: the same ops in the same order. A second
    case keeps an epilogue that writes another dtype (a cast to float16 before the
    reshape) apart from what follows, and stays right."""
    from tests.conftest import build_both, build_model

    m, k, n = 37, 64, 96

    def body(bb, x, w, b, v):
        y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, w)), b))
        g = bb.emit(relax.op.nn.gelu(bb.emit(relax.op.reshape(y, (m, n)))))
        h = bb.emit(relax.op.astype(bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, v)), b)), "float16"))
        r = bb.emit(relax.op.nn.relu(bb.emit(relax.op.reshape(h, (m, n)))))
        return [bb.emit(relax.op.reshape(g, (1, m, n))), r]

    shapes = {"x": (1, m, k), "w": (k, n), "b": (n,), "v": (k, n)}
    mod = build_model({name: (s, "float32") for name, s in shapes.items()}, body)
    rng = np.random.default_rng(5)
    x, w, b, v = (rng.standard_normal(s).astype("float32") for s in shapes.values())
    mod = relax.transform.BindParams("main", {"w": w, "b": b, "v": v})(mod)
    if low:
        mod = jitbyoc.lower_precision(mod, "bf16")
    gelus = [s for s in stages(mod) if "gelu" in repr(getattr(s, "epilogue", None))]
    assert len(gelus) == 1 and isinstance(gelus[0], MatMul), [type(s).__name__ for s in stages(mod)]
    assert "'add'" in repr(gelus[0].epilogue)
    (want_g, want_r), (got_g, got_r) = build_both(mod).run(x)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_r.astype("float32"), want_r.astype("float32"), rtol=1e-3, atol=1e-3)

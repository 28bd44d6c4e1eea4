"""Adversarial tests: models, names and switches that jitbyoc did not make.

Hash-colliding shapes must never share code (in memory, on disk, in the partition memo);
the user's names are data (never a printf format, never C or LLVM text); symbolic sizes
are told apart by object, not by name; the on/off switch counts overlapping blocks.
The cache directory's own attacks are in ``test_cache_trust.py``.
"""

from __future__ import annotations

import importlib
import itertools
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.pipeline import PIPELINE_MAP

import jitbyoc
from jitbyoc.toolchain import cache, compile_pool
from jitbyoc.tvm import partition
from tests.conftest import build_model, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- hash collisions ----------------------------------------------------------------------

def colliding_shapes(size: int, limit: int = 3) -> list[tuple]:
    """Pairs of 2-D shapes with ``size`` elements whose TVM structural hashes are equal."""
    by_hash: dict[int, tuple] = {}
    pairs = []
    for a in range(1, size + 1):
        if size % a:
            continue
        shape = (a, size // a)
        h = tvm_ffi.structural_hash(relax.ShapeExpr(list(shape)))
        if h in by_hash:
            pairs.append((by_hash[h], shape))
        by_hash.setdefault(h, shape)
    return pairs[:limit]


def _pairs() -> list[tuple]:
    found = []
    for size in range(2, 20000):
        found += colliding_shapes(size, 1)
        if len(found) >= 3:
            return found
    return found


COLLIDING = _pairs()
OPS = {
    "softmax": (lambda y: relax.op.nn.softmax(y, axis=-1),
                lambda y: np.exp(y - y.max(-1, keepdims=True)) / np.exp(y - y.max(-1, keepdims=True)).sum(-1, keepdims=True)),
    "log_softmax": (lambda y: relax.op.nn.log_softmax(y, axis=-1),
                    lambda y: y - y.max(-1, keepdims=True) - np.log(np.exp(y - y.max(-1, keepdims=True)).sum(-1, keepdims=True))),
    "softmax_scaled": (lambda y: relax.op.multiply(relax.op.nn.softmax(y, axis=-1), relax.const(3.0, "float32")),
                       lambda y: 3 * np.exp(y - y.max(-1, keepdims=True)) / np.exp(y - y.max(-1, keepdims=True)).sum(-1, keepdims=True)),
}


def reshaped(shape: tuple, op: str) -> tvm.IRModule:
    """``reshape(x, shape) -> op -> reshape`` over a flat input."""
    size = shape[0] * shape[1]

    def body(bb, x):
        y = bb.emit(relax.op.reshape(x, shape))
        z = bb.emit(OPS[op][0](y))
        return bb.emit(relax.op.reshape(z, (-1,)))

    return build_model({"x": ((size,), "float32")}, body)


def expected(shape: tuple, op: str, x: np.ndarray) -> np.ndarray:
    return OPS[op][1](x.reshape(shape)).reshape(-1)


@pytest.mark.parametrize("op", sorted(OPS))
def test_collisions_are_found(op):
    """The pairs collide for real: TVM's structural hash of the two regions (what keyed
    code before) is equal, though they compute different things."""
    assert len(COLLIDING) >= 3, "the sweep should find colliding shape pairs"
    for pair in COLLIDING:
        regions = [partition.regions(partition.partition_for_jitbyoc(reshaped(s, op))) for s in pair]
        a, b = (next(iter(r.values())).without_attr("global_symbol") for r in regions)
        assert tvm_ffi.structural_hash(a) == tvm_ffi.structural_hash(b)
        assert not tvm_ffi.structural_equal(a, b)


@pytest.mark.parametrize("op", sorted(OPS))
def test_colliding_shapes_never_share_code(op, tmp_path):
    cache.configure(path=tmp_path / "cache", enabled=True)
    cache.clear_memory()
    rng = np.random.default_rng(0)
    for p, q in COLLIDING:
        x = rng.standard_normal(p[0] * p[1]).astype("float32")
        for shape in (p, q, p):  # each after the other: memory cache, symbols, memos
            with jitbyoc.enabled():
                ex = tvm.compile(reshaped(shape, op), target="llvm")
            got = run(relax.VirtualMachine(ex, tvm.cpu()), x)
            np.testing.assert_allclose(got, expected(shape, op, x), rtol=2e-5, atol=1e-6,
                                       err_msg=f"{op} on {shape} (collides with {p if shape == q else q})")
    symbols = {jitbyoc.report(reshaped(s, op)).regions[0].symbol for pair in COLLIDING for s in pair}
    assert len(symbols) == 2 * len(COLLIDING)


FRESH = textwrap.dedent("""
    import sys, numpy as np, tvm
    from tvm import relax
    import jitbyoc
    from tests.test_trust import reshaped, expected
    jitbyoc.cache.configure(path=sys.argv[1], enabled=True)
    shape = tuple(int(v) for v in sys.argv[2].split("x"))
    x = np.random.default_rng(1).standard_normal(shape[0] * shape[1]).astype("float32")
    with jitbyoc.enabled():
        ex = tvm.compile(reshaped(shape, "softmax"), target="llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    print(jitbyoc.last_report().regions[0].cache)
    np.testing.assert_allclose(got, expected(shape, "softmax", x), rtol=2e-6, atol=1e-6)
""")


def test_colliding_shape_from_disk_in_a_fresh_process(tmp_path):
    """A process that only ever builds the (4, 59)-like model gets its own code, not the
    entry another process wrote for the colliding shape."""
    (p, q), root = COLLIDING[0], tmp_path / "cache"
    for shape, status in ((p, "compiled"), (q, "compiled"), (q, "cache hit (disk)")):
        out = subprocess.run([sys.executable, "-c", FRESH, str(root), "x".join(map(str, shape))],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().endswith(status), (shape, out.stdout)


def test_module_memo_is_keyed_by_identity_not_hash():
    """Structurally equal modules partition alike, but the memo hands back a module's own
    partition only for the same functions (an edited module, even one whose hash equals
    the old one's, is partitioned again)."""
    p, q = COLLIDING[0]
    a, b = reshaped(p, "softmax"), reshaped(q, "softmax")
    pa, pb = partition.partition_for_jitbyoc(a), partition.partition_for_jitbyoc(b)
    assert not tvm_ffi.structural_equal(pa, pb)
    assert tvm_ffi.structural_equal(partition.partition_for_jitbyoc(a), pa)


# ---- hostile names ------------------------------------------------------------------------

HOSTILE = ["x%s%s%s%s%n", "%p %p %p", 'q"uote\'s', "back\\slash\\", "new\nline\r",
           "c*/omment/*", "#define X 1", "emoji\U0001F600", "ctl\x01\x07\x1b[31m", "nul\x00byte",
           "y" * 500, "??=trigraph", "$dollar.dot-dash", "const", "sym0"]


def _two_input_model(name: str, size_name: str = "n") -> tvm.IRModule:
    n = tvm.tirx.Var(size_name, "int64")
    x = relax.Var(name, relax.TensorType([n, 8], "float32"))
    y = relax.Var("w", relax.TensorType([8], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(x, y)))
        bb.emit_func_output(out)
    return bb.get()


def _entry(ex, mod):
    return ex.mod.get_function(jitbyoc.report(mod).regions[0].symbol, query_imports=True)


def _shown(name: str) -> str:
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    return text if len(text) <= 200 else text[:200] + "..."


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_names_are_data(name, tmp_path):
    """A hostile input name and size name: the build works, a rejected call raises a
    ValueError quoting the names literally (no printf expansion, no crash), and the C
    rendering keeps them out of its code."""
    mod = _two_input_model(name, size_name=name)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    x, w = np.ones((3, 8), "float32"), np.arange(8, dtype="float32")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy(), x + w)
    f = _entry(ex, mod)
    out = tvm.runtime.tensor(np.zeros((3, 8), "float32"))
    with pytest.raises(ValueError) as err:
        f(tvm.runtime.tensor(x), tvm.runtime.tensor(np.ones(7, "float32")), out)  # w has 7, not 8
    assert "argument 1 ('w', input 1)" in str(err.value)
    with pytest.raises(ValueError) as err:
        f(tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(np.zeros((2, 8), "float32")))
    assert f"expected shape ({_shown(name)}, 8), but shape[0] is 2 (expected {_shown(name)} = 3)" in str(err.value)
    with pytest.raises(ValueError) as err:
        f(tvm.runtime.tensor(np.ones((3, 8), "float64")), tvm.runtime.tensor(w), out)
    assert f"argument 0 ('{_shown(name)}', input 0): expected dtype float32" in str(err.value)
    (region,) = jitbyoc.inspect(mod)
    code = region.c_source.split("static const char* const jb_names_")[0]  # before the names table
    if name not in ("const", "sym0"):  # these two are also words jitbyoc itself writes
        assert name not in code and name not in region.llvm_ir  # the code holds no names at all
    assert "\n#define X" not in region.c_source and "??=" not in region.c_source
    _compile_c(region.c_source, tmp_path)


def _compile_c(source: str, tmp_path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return  # the rest of the test still ran; nothing to compile with here
    src = tmp_path / "region.c"
    src.write_text(source)
    out = subprocess.run([cc, "-std=c11", "-O0", "-Werror=implicit-function-declaration", "-c", str(src),
                          "-o", str(tmp_path / "region.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


def test_hostile_function_name():
    x = relax.Var("x", relax.TensorType([4], "float32"))
    bb = relax.BlockBuilder()
    fname = "main%s%n\"*/"
    with bb.function(fname, [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.exp(x))
        bb.emit_func_output(out)
    with jitbyoc.enabled():
        ex = tvm.compile(bb.get(), target="llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())[fname](tvm.runtime.tensor(np.zeros(4, "float32"))).numpy()
    np.testing.assert_allclose(got, np.ones(4), rtol=1e-6)


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_error_names_this_models_arguments(source, tmp_path):
    """Structurally equal models with other names share code but report their own names,
    whether the code comes from the memory cache or from disk."""
    cache.configure(path=tmp_path / "cache", enabled=True)
    cache.clear_memory()
    bad = tvm.runtime.tensor(np.ones((2, 8), "float32"))
    msgs = []
    for name in ("first_model_input", "image"):
        if source == "disk":
            cache.clear_memory()
            partition._MEMO.clear()
        mod = _two_input_model(name)
        with jitbyoc.enabled():
            ex = tvm.compile(mod, target="llvm")
        status = jitbyoc.last_report().regions[0].cache
        f = _entry(ex, mod)
        with pytest.raises(ValueError) as err:
            f(tvm.runtime.tensor(np.ones((3, 8), "float64")), tvm.runtime.tensor(np.ones(8, "float32")), bad)
        msgs.append((str(err.value), status))
    assert "('first_model_input', input 0)" in msgs[0][0]
    assert "('image', input 0)" in msgs[1][0] and "first_model_input" not in msgs[1][0]
    assert msgs[1][1] == f"cache hit ({source})", "same code: the second build reuses it"


def test_two_sizes_with_one_name_are_two_sizes():
    """Two distinct size vars both called ``n``: TVM takes (5, 8) and (3, 8), so must jitbyoc."""
    n1, n2 = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n1, 8], "float32"))
    y = relax.Var("y", relax.TensorType([n2, 8], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.relu(x))
            b = bb.emit(relax.op.negative(y))
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    mod = bb.get()
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    assert jitbyoc.last_report().regions, "offloaded"
    xs, ys = np.linspace(-1, 1, 40, dtype="float32").reshape(5, 8), np.ones((3, 8), "float32")
    got = run(relax.VirtualMachine(ex, tvm.cpu()), xs, ys)
    np.testing.assert_array_equal(got[0], np.maximum(xs, 0))
    np.testing.assert_array_equal(got[1], -ys)


# ---- the switch ---------------------------------------------------------------------------

def test_overlapping_enabled_blocks_across_threads():
    """A enters, B enters, A exits: still on inside B; after both exit: off."""
    jitbyoc.disable()
    steps = [threading.Event() for _ in range(4)]
    seen = {}

    def a():
        with jitbyoc.enabled():
            steps[0].set()
            steps[1].wait(10)
        steps[2].set()

    def b():
        steps[0].wait(10)
        with jitbyoc.enabled():
            steps[1].set()
            steps[2].wait(10)
            seen["inside B after A left"] = jitbyoc.is_enabled()
            with jitbyoc.enabled():
                tvm.compile(_two_input_model("x"), target="llvm")
            seen["offloaded"] = bool(jitbyoc.last_report().regions)
        steps[3].set()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen == {"inside B after A left": True, "offloaded": True}
    assert not jitbyoc.is_enabled()
    assert not hasattr(PIPELINE_MAP["default"], "jitbyoc_original"), "TVM's pipeline is back"


def test_disabled_block_wins_and_blocks_nest():
    jitbyoc.enable()
    try:
        with jitbyoc.disabled():
            assert not jitbyoc.is_enabled()
            with jitbyoc.enabled():
                assert not jitbyoc.is_enabled()
        assert jitbyoc.is_enabled()
        with pytest.raises(TypeError, match="enabled"):
            with jitbyoc.enable():
                pass
    finally:
        jitbyoc.disable()
    assert not jitbyoc.is_enabled()


def test_reload_while_enabled_then_disable():
    originals = {k: PIPELINE_MAP[k] for k in ("default", "default_build")}
    jitbyoc.enable()
    try:
        importlib.reload(jitbyoc.tvm.hook)
    finally:
        jitbyoc.disable()
    assert {k: PIPELINE_MAP[k] for k in originals} == originals
    ex = tvm.compile(_two_input_model("x"), target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(np.ones((2, 8), "float32")),
                                                      tvm.runtime.tensor(np.ones(8, "float32")))
    np.testing.assert_array_equal(out.numpy(), np.full((2, 8), 2, "float32"))
    with jitbyoc.enabled():
        tvm.compile(_two_input_model("x"), target="llvm")
        assert jitbyoc.last_report().regions


def test_every_canonical_field_counts():
    """The code key changes with anything that changes the code: a shape, a dtype, an
    attribute, an op; never with a name."""
    from jitbyoc.lower import lower_region
    keys = {}
    for name, shape, axis in itertools.product(("a", "b"), ((4, 6), (6, 4)), (0, 1)):
        x = relax.Var(name, relax.TensorType(list(shape), "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.nn.softmax(x, axis=axis))
            bb.emit_func_output(out)
        (func,) = partition.regions(partition.partition_for_jitbyoc(bb.get())).values()
        keys[name, shape, axis] = lower_region(func).key
    assert keys["a", (4, 6), 0] == keys["b", (4, 6), 0]
    assert len({keys[k] for k in keys if k[0] == "a"}) == 4


def _same_region_in_two_functions(prefixes):
    bb = relax.BlockBuilder()
    for fname, pre in zip(("main", "second"), prefixes):
        x = relax.Var(pre + "x", relax.TensorType((4, 8), "float32"))
        w = relax.Var(pre + "w", relax.TensorType((8, 8), "float32"))
        with bb.function(fname, [x, w]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
            bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("target", ["llvm", "c"])
def test_one_regions_code_called_from_two_functions_reports_each_callers_names(target):
    """Two functions with the same region under other names: TVM's BlockBuilder merged
    their region functions, names aside, and the second function's errors named the
    first's arguments. Same names still make one region function."""
    with jitbyoc.enabled():
        ex = tvm.compile(_same_region_in_two_functions(("a_", "b_")), target=target)
    regions = jitbyoc.last_report().regions
    assert len(regions) == 2 and len({r.symbol.rsplit("_", 1)[0] for r in regions}) == 1  # one code
    vm = relax.VirtualMachine(ex, tvm.cpu())
    strided = tvm_ffi.from_dlpack(np.ones((4, 16), "float32")[:, ::2])
    w = tvm.runtime.tensor(np.ones((8, 8), "float32"))
    for fname, name, other in (("main", "a_x", "b_x"), ("second", "b_x", "a_x")):
        with pytest.raises(ValueError) as err:
            vm[fname](strided, w)
        assert f"('{name}', input 0)" in str(err.value) and other not in str(err.value)
    good = tvm.runtime.tensor(np.ones((4, 8), "float32"))
    np.testing.assert_allclose(vm["second"](good, w).numpy(), np.full((4, 8), 8.0))
    with jitbyoc.enabled():
        tvm.compile(_same_region_in_two_functions(("", "")), target=target)
    assert len(jitbyoc.last_report().regions) == 1


@pytest.mark.parametrize("name,read", [
    ("JITBYOC_CACHE_MAX_BYTES", lambda: cache._Settings().max_bytes),
    ("JITBYOC_COMPILE_WORKERS", compile_pool.pool),
    ("JITBYOC_COMPILE_TIMEOUT", lambda: compile_pool.deadline("")),
])
def test_a_setting_that_is_not_a_number_warns_and_takes_the_default(name, read, monkeypatch, caplog):
    """``JITBYOC_CACHE_MAX_BYTES=1GB`` made ``import jitbyoc`` fail with int()'s ValueError
    (and a bad worker count or timeout failed the build in progress)."""
    monkeypatch.delenv(name, raising=False)
    default = read()
    monkeypatch.setenv(name, "1GB")
    with caplog.at_level("WARNING", logger="jitbyoc"):
        assert read() == default
    assert name in caplog.text and "'1GB'" in caplog.text

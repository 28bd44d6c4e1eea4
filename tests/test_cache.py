"""The compile cache (memory and disk), build lifetime and thread safety."""

import os
import re
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import cache, driver
from jitbyoc.engines import PREFIX as ENGINE_PREFIX
from tests import models
from tests.conftest import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_cache(tmp_path):
    cache.configure(path=tmp_path / "cache", enabled=True)
    cache.clear_memory()
    yield tmp_path / "cache"
    cache.configure(path=tmp_path / "unused", enabled=True)
    cache.clear_memory()


def build_status(mod):
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    return ex, [r.cache for r in jitbyoc.last_report().regions]


def entries(root, engines: bool = False, kind: str = ENGINE_PREFIX):
    """Disk entries of regions (with ``engines``: of library engines, those whose symbol
    starts with ``kind``), told apart by the key each entry stores (magic, checksum, key
    length, key text, payload)."""
    def is_engine(p):
        _, _, size, rest = p.read_bytes().split(b"\n", 3)
        return rest[:int(size)].startswith(kind.encode())
    return sorted(p for p in root.glob("*/*.s") if is_engine(p) == engines)


def matmul_relu(m: int, k: int, n: int) -> tvm.IRModule:
    return build_model({"x": ((m, k), "float32"), "w": ((k, n), "float32")},
                       lambda bb, x, w: bb.emit(relax.op.nn.relu(relax.op.matmul(x, w))))


def engine_status() -> dict:
    return {s: v for s, v in driver.last_cache_status().items() if s.startswith(ENGINE_PREFIX)}


def test_engines_are_compiled_once_and_shared(fresh_cache):
    """Two products of different sizes run on one compiled GEMM engine: the second build
    compiles only its own region; a new process takes both from disk."""
    rng = np.random.default_rng(0)
    for step, (m, k, n) in enumerate([(33, 70, 45), (8, 300, 17)]):
        ex, status = build_status(matmul_relu(m, k, n))
        assert status == ["compiled"]
        assert set(engine_status().values()) == ({"compiled"} if step == 0 else {"memory"})
        x, w = rng.standard_normal((m, k), "float32"), rng.standard_normal((k, n), "float32")
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
        np.testing.assert_allclose(out.numpy(), np.maximum(x @ w, 0), rtol=1e-4, atol=1e-4)
    assert len(entries(fresh_cache)) == 2 and entries(fresh_cache, engines=True)
    cache.clear_memory()
    build_status(matmul_relu(33, 70, 45))
    assert set(engine_status().values()) == {"disk"}


def test_one_gemm_engine_serves_plain_and_batched_products(fresh_cache):
    """A plain product and a batched one (attention-like: rank-1 and rank-2 batch, one
    broadcast) call the same engine: a model pays its compile time once."""
    rng = np.random.default_rng(1)
    shapes = {"x": ((5, 24), "float32"), "w": ((24, 7), "float32"),
              "a": ((3, 5, 24), "float32"), "b": ((2, 1, 24, 9), "float32")}

    def body(bb, x, w, a, b):
        y = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w)))
        z = bb.emit(relax.op.nn.relu(relax.op.matmul(a, b)))  # (2, 3, 5, 9)
        return [y, z]

    with jitbyoc.enabled():
        ex = tvm.compile(build_model(shapes, body), target="llvm")
    gemm = [s for s in engine_status() if "_gemm_" in s]
    assert len(gemm) == 1 and len(jitbyoc.last_report().regions) == 2, engine_status()
    args = {k: rng.standard_normal(v[0], "float32") for k, v in shapes.items()}
    y, z = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(v) for v in args.values()])
    np.testing.assert_allclose(y.numpy(), np.maximum(args["x"] @ args["w"], 0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(z.numpy(), np.maximum(args["a"] @ args["b"], 0), rtol=1e-4, atol=1e-4)


MICRO = ENGINE_PREFIX + "micro_"


def test_two_gemm_engines_share_their_microkernels(fresh_cache):
    """A product with an input weight and a linear layer with a constant one (packed at
    build time) run on two GEMM engines; their microkernels are engines of their own,
    compiled once for both (each GEMM engine carried its own copies)."""
    rng = np.random.default_rng(2)
    w2 = rng.standard_normal((256, 128), "float32")

    def body(bb, x, w):
        y = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w)))
        return bb.emit(relax.op.linear(y, relax.const(w2)))

    with jitbyoc.enabled():
        ex = tvm.compile(build_model({"x": ((64, 128), "float32"), "w": ((128, 128), "float32")}, body),
                         target="llvm")
    status = engine_status()
    gemm = [s for s in status if "_gemm_" in s]
    micro = {s for s in status if s.startswith(MICRO)}
    assert len(gemm) == 2 and micro, status
    for g in gemm:
        code = driver._cached(cache.key(g))[0]
        assert not re.search(r"_gemm_float32_\d+x\d+_u\d+\w*:", code.asm), g  # no microkernel of its own
        assert code.calls and code.calls <= micro, g  # each calls shared microkernels (cached with it)
        assert all(s in code.asm for s in code.calls), g
    x, w = rng.standard_normal((64, 128), "float32"), rng.standard_normal((128, 128), "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    np.testing.assert_allclose(out.numpy(), np.maximum(x @ w, 0) @ w2.T, rtol=1e-4, atol=1e-3)


def test_a_cached_engine_whose_microkernels_are_gone_gets_them_compiled(fresh_cache):
    """The GEMM engine comes from disk, its microkernels' entries do not (evicted): the
    build follows the engine's own calls and compiles them, rather than loading a module
    whose calls go nowhere."""
    build_status(matmul_relu(16, 24, 16))
    gone = entries(fresh_cache, engines=True, kind=MICRO)
    for p in gone:
        p.unlink()
    assert gone
    cache.clear_memory()
    ex, status = build_status(matmul_relu(16, 24, 16))
    engines = engine_status()
    assert status == ["cache hit (disk)"], status
    assert {v for s, v in engines.items() if s.startswith(MICRO)} == {"compiled"}, engines
    x, w = np.ones((16, 24), "float32"), np.ones((24, 16), "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    np.testing.assert_array_equal(out.numpy(), 24)


def test_corrupt_engine_entry_is_rewritten(fresh_cache):
    build_status(matmul_relu(16, 16, 16))
    for entry in entries(fresh_cache, engines=True):
        entry.write_bytes(entry.read_bytes()[:100])
    cache.clear_memory()
    ex, _ = build_status(matmul_relu(16, 16, 16))
    assert set(engine_status().values()) == {"compiled"}
    x = np.ones((16, 16), "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(x))
    np.testing.assert_array_equal(out.numpy(), 16)


def test_memory_then_disk_hits(fresh_cache):
    _, first = build_status(models.Branchy)
    assert first == ["compiled", "compiled"]
    _, second = build_status(models.Branchy)
    assert second == ["cache hit (memory)"] * 2
    cache.clear_memory()
    ex, third = build_status(models.Branchy)
    assert third == ["cache hit (disk)"] * 2
    a, b = np.ones((4, 8), "float32"), np.full(8, 2, "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](
        tvm.runtime.tensor(np.array(True)), tvm.runtime.tensor(a), tvm.runtime.tensor(b))
    np.testing.assert_array_equal(out.numpy(), 3)


def test_changed_layer_recompiles_only_its_region(fresh_cache):
    build_status(models.AddReluSmall)
    _, status = build_status(models.AddReluLarge)  # another shape: another region
    assert status == ["compiled"]
    _, status = build_status(models.AddReluSmallOtherConst)  # same content as AddReluSmall
    assert status == ["cache hit (memory)"]


def test_entries_are_private_and_checked(fresh_cache):
    build_status(models.SeedExample)
    (entry,) = entries(fresh_cache)
    assert not entry.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert not entry.parent.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert entry.read_bytes().startswith(cache.MAGIC)
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entry_is_ignored_and_rewritten(fresh_cache, damage):
    build_status(models.SeedExample)
    (entry,) = entries(fresh_cache)
    good = entry.read_bytes()
    bad = {"truncate": good[: len(good) // 2], "flip": good[:-10] + b"X" + good[-9:], "empty": b""}[damage]
    entry.write_bytes(bad)
    cache.clear_memory()
    ex, status = build_status(models.SeedExample)
    assert status == ["compiled"]
    assert entry.read_bytes() == good
    args = [np.full((10, 10), k, "float32") for k in (1, 2, 3, 4)]
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, args)).numpy()
    np.testing.assert_array_equal(out, (1 + 2 - 3) * 4)


def test_size_bound_evicts_least_recently_used(fresh_cache):
    for mod in (models.SeedExample, models.AddReluSmall, models.AddReluLarge):
        build_status(mod)
    sizes = {p: p.stat().st_size for p in entries(fresh_cache)}
    assert len(sizes) == 3
    oldest = min(sizes, key=lambda p: p.stat().st_mtime)
    os.utime(oldest, (1, 1))
    cache.configure(max_bytes=sum(sizes.values()) - 1)
    try:
        cache.clear_memory()
        build_status(models.Symbolic)  # a fourth entry forces eviction
    finally:
        cache.configure(max_bytes=256 << 20)
    left = entries(fresh_cache)
    assert oldest not in left
    assert sum(p.stat().st_size for p in left) <= sum(sizes.values()) - 1


def test_disabled_cache_writes_nothing(fresh_cache):
    cache.configure(enabled=False)
    try:
        build_status(models.SeedExample)
    finally:
        cache.configure(enabled=True)
    assert entries(fresh_cache) == [] and entries(fresh_cache, engines=True) == []


REUSE = textwrap.dedent("""
    import jitbyoc, tvm
    from tests import models
    jitbyoc.enable()
    tvm.compile(models.Branchy, target="llvm")
    print(sorted(r.cache for r in jitbyoc.last_report().regions))
""")


def test_disk_cache_is_reused_across_processes_and_follows_env(tmp_path):
    env = dict(os.environ, JITBYOC_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=ROOT)
    runs = [subprocess.run([sys.executable, "-c", REUSE], env=env, cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip() for _ in range(2)]
    assert runs == ["['compiled', 'compiled']", "['cache hit (disk)', 'cache hit (disk)']"]
    env["JITBYOC_CACHE"] = "0"
    off = subprocess.run([sys.executable, "-c", REUSE], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert off == "['compiled', 'compiled']"


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setattr(cache.SETTINGS, "path", None)
    monkeypatch.delenv("JITBYOC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.SETTINGS.directory() == tmp_path / "jitbyoc"


def _model(k: int):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((k + 3, 16), "float32"))
    with bb.function("main", [a]):
        with bb.dataflow():
            x = bb.emit(relax.op.nn.relu(relax.op.add(a, relax.const(float(k), "float32"))))
            y = bb.emit(relax.op.sort(x, axis=1))  # stays with TVM: its passes run too
            gv = bb.emit_output(relax.op.multiply(y, relax.const(2.0, "float32")))
        bb.emit_func_output(gv)
    return bb.get()


def test_eight_threads_build_and_run_concurrently():
    mods = {k: _model(k) for k in range(8)}  # BlockBuilder itself is not thread-safe
    errors = []

    def work(k):
        try:
            for _ in range(3):
                ex = tvm.compile(mods[k], target="llvm")
                a = np.random.default_rng(k).standard_normal((k + 3, 16)).astype("float32")
                out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a)).numpy()
                np.testing.assert_allclose(out, np.sort(np.maximum(a + k, 0), axis=1) * 2,
                                           rtol=1e-5, atol=1e-5)
        except Exception as err:  # collected and asserted below, in the main thread
            errors.append(f"model {k}: {type(err).__name__}: {err}")

    with jitbyoc.enabled():
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a build deadlocked"
    assert errors == []


LIFETIME = textwrap.dedent("""
    import os, numpy as np, tvm
    from tvm import relax
    import jitbyoc
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    def model(n):  # 24 shapes: more than jitbyoc keeps loaded, so old builds are freed
        bb = relax.BlockBuilder()
        a = relax.Var("a", relax.TensorType((8, n), "float32"))
        with bb.function("main", [a]):
            with bb.dataflow():
                gv = bb.emit_output(relax.op.nn.relu(relax.op.add(a, relax.const(1.0, "float32"))))
            bb.emit_func_output(gv)
        return bb.get()
    mods = {n: model(n) for n in range(1, 25)}
    jitbyoc.enable()
    for i in range(1000):
        n = 1 + i % 24
        ex = tvm.compile(mods[n], target="llvm")
        x = np.full((8, n), -0.5, "float32")
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert (out == 0.5).all()
        if i == 48:
            base = rss_mb()
    print(rss_mb() - base)
""")



@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read resident memory")
def test_thousand_rebuilds_keep_memory_bounded():
    env = dict(os.environ, PYTHONPATH=ROOT, JITBYOC_CACHE="0")
    out = subprocess.run([sys.executable, "-c", LIFETIME], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    growth = float(out.stdout.strip().splitlines()[-1])
    assert growth < 50, f"resident memory grew by {growth:.1f} MB over 950 rebuilds"


def test_writes_under_the_bound_do_not_rescan_the_directory(fresh_cache, monkeypatch):
    """The directory is scanned once per process, then only when the running size
    estimate passes the bound (a full cache holds thousands of entries)."""
    scans = []
    real = cache._evict
    monkeypatch.setattr(cache, "_evict", lambda root: (scans.append(root), real(root)))
    for i in range(20):
        cache.put(cache.key(f"entry{i}"), "x" * 1000)
    assert len(scans) == 1
    cache.configure(max_bytes=5 * 1100)
    try:
        cache.put(cache.key("one more"), "x" * 1000)  # past the bound: scan and evict
    finally:
        cache.configure(max_bytes=256 << 20)
    assert len(scans) == 2
    assert cache.disk_usage() <= 5 * 1100

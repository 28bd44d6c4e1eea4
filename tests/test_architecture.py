"""The package's shape: imports point one way, errors say where they happened, and the
rule registry is the one table patterns, lowering and the report read."""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest
import tvm
from tvm.script import relax as R

import jitbyoc
from jitbyoc import lower
from jitbyoc.ir import rules
from jitbyoc.ir.errors import CompileError, LoweringError, RenderError
from jitbyoc.ir.ops import OPS
from jitbyoc.kernels.softmax import Softmax
from jitbyoc.tvm import patterns
from tests.conftest import build_both, jit_function

ROOT = pathlib.Path(jitbyoc.__file__).parent
# Lower layers never import higher ones. Leaf modules (no jitbyoc imports) sit below all.
LAYERS = ["memo", "context", "version", "compat", "threads", "ir", "render", "engines", "kernels", "lower",
          "toolchain", "peak", "profile", "tvm", "__init__"]
OPTIONAL = {"torch", "onnx", "onnxruntime", "transformers"}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    rest = module.split(".")[1:] or ["__init__"]
    return LAYERS.index(rest[0])


def _imports(path: pathlib.Path):
    """(module-level?, imported jitbyoc module or top-level package) of every import."""
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (ROOT.parent / sub.replace(".", "/")).is_dir()
                yield id(node) in top, sub if is_module else target
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                yield id(node) in top, name


def test_imports_point_down_the_layers_and_are_made_at_module_level():
    upward, local = [], []
    for path in ROOT.rglob("*.py"):
        here = _module(path)
        for module_level, target in _imports(path):
            if not module_level and target.split(".")[0] not in OPTIONAL:
                local.append(f"{here} -> {target}")
            if target.startswith("jitbyoc") and target != here and _layer(target) > _layer(here):
                upward.append(f"{here} -> {target}")
    assert local == [], "imports inside functions (only optional dependencies may be)"
    assert upward == [], "imports from a higher layer"


def test_no_import_circles():
    graph = {}
    for path in ROOT.rglob("*.py"):
        graph[_module(path)] = {t for top, t in _imports(path) if top and t.startswith("jitbyoc")}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in graph.get(m, ()):
            if state.get(t) == 1:
                pytest.fail(f"import circle: {' -> '.join(stack[stack.index(t):] + [t])}")
            if t in graph and t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_every_relax_row_and_kernel_has_one_rule():
    assert {row.relax for row in OPS.values() if row.relax} <= set(rules.RULES)
    assert rules.anchor_ops() == {"relax.matmul", "relax.nn.conv2d", "relax.nn.conv1d"}
    names = [p[0] for p in patterns.patterns()]
    assert len(names) == len(set(names))
    assert {f"jitbyoc.{op.removeprefix('relax.')}" for op in rules.RULES} <= set(names)
    with pytest.raises(ValueError, match="two rules"):
        rules.add(rules.RULES["relax.add"])


@R.function
def _softmax(x: R.Tensor((4, 16), "float32")):
    with R.dataflow():
        y = R.nn.softmax(R.add(x, x))
        R.output(y)
    return y


def _region():
    (region,) = jitbyoc.inspect(tvm.IRModule({"main": _softmax}))
    return region


def test_lowering_errors_name_the_region_and_the_op(monkeypatch):
    rule = rules.RULES["relax.nn.softmax"]

    def broken(fe, call, out):
        raise ZeroDivisionError("boom")

    monkeypatch.setitem(rules.RULES, "relax.nn.softmax", rules.Rule(rule.relax, rule.arity, rule.check, broken))
    with pytest.raises(LoweringError, match=r"lowering region 'r0', op relax.nn.softmax failed: "
                                            r"ZeroDivisionError: boom"):
        lower.lower_region(_softmax, "r0")


def test_rendering_errors_name_the_region_and_the_stage(monkeypatch):
    region = _region()
    monkeypatch.setattr(Softmax, "emit_llvm", lambda self, ctx: 1 / 0)
    monkeypatch.setattr(Softmax, "emit_c", lambda self, ctx: 1 / 0)
    with pytest.raises(RenderError, match=rf"rendering region '{region.kernel.name}', Softmax stage "
                                          r"of '\w+ = relax.nn.softmax\(...\)' in LLVM failed: ZeroDivisionError"):
        region.llvm_ir  # noqa: B018
    with pytest.raises(RenderError, match=r"Softmax stage of '\w+ = relax.nn.softmax\(...\)' in C failed"):
        region.c_source  # noqa: B018


def test_entry_engine_and_optimizer_errors_name_the_region(monkeypatch):
    """The steps around a region's stages have error contexts too: its entry (the
    argument checks, in LLVM and C), optimizing its IR, and a library engine's IR."""
    from jitbyoc.render import isa
    from jitbyoc.toolchain import c_entry, driver, llvm_entry
    region = _region()
    monkeypatch.setattr(llvm_entry, "emit_entry", lambda *a: 1 / 0)
    monkeypatch.setattr(c_entry, "emit_entry", lambda *a: 1 / 0)
    with pytest.raises(RenderError, match=rf"region '{region.kernel.name}', its entry .* in LLVM failed"):
        region.llvm_ir  # noqa: B018
    with pytest.raises(RenderError, match=rf"region '{region.symbol}', its entry .* in C failed"):
        region.c_source  # noqa: B018
    monkeypatch.undo()
    region = _region()
    region.__dict__["llvm_ir"] = "this is not LLVM IR"
    with pytest.raises(CompileError, match=rf"region '{region.symbol}', optimizing its IR failed"):
        region.llvm_ir_optimized  # noqa: B018
    monkeypatch.setattr(driver, "emit_engine", lambda *a: 1 / 0)
    with pytest.raises(RenderError, match=r"region 'jitbyoc_lib_args', library engine failed"):
        driver._engine_job("jitbyoc_lib_args", isa.host())


def test_compile_errors_name_the_region():
    region = _region()
    region.__dict__["llvm_ir"] = "this is not LLVM IR"
    with pytest.raises(CompileError, match=rf"compiling region '{region.symbol}' failed"):
        region.asm  # noqa: B018


def test_the_region_still_builds_and_runs():
    """(the fixture model above is a real one)"""
    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    out = tvm.runtime.empty((4, 16), "float32")
    jit_function(_region())(tvm.runtime.tensor(x), out)
    e = np.exp(2 * x - (2 * x).max(axis=1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), e / e.sum(axis=1, keepdims=True), rtol=1e-5)


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{_module(path)}.{node.name}: {n} lines")
    assert long == []


@pytest.mark.check_miss
def test_a_lowering_failure_leaves_the_op_to_tvm(monkeypatch, rules_check_what_they_build):
    """A call whose rule accepts it but whose lowering fails is rejected at partition time:
    the build succeeds, the op runs in TVM, the report says why (jitbyoc never fails a
    build that TVM alone passes), and it is logged as the bug it is, which every other
    test fails on (tests/conftest.py)."""
    rule = rules.RULES["relax.nn.softmax"]

    def broken(fe, call, out):
        raise ZeroDivisionError("boom")

    monkeypatch.setitem(rules.RULES, "relax.nn.softmax", rules.Rule(rule.relax, rule.arity, rule.check, broken))
    x = np.random.default_rng(1).standard_normal((4, 16)).astype("float32")
    builds = build_both(tvm.IRModule({"main": _softmax.with_attr("global_symbol", "main")}))
    (fallback,) = builds.report.fallbacks
    assert fallback.op == "relax.nn.softmax" and "lowering failed" in fallback.reason and "boom" in fallback.reason
    assert builds.report.offloaded_ops == 1  # the add
    tvm_out, jit_out = builds.run(x)
    np.testing.assert_array_equal(jit_out, tvm_out)
    (miss,) = rules_check_what_they_build.found
    assert "relax.nn.softmax" in miss and "boom" in miss and "a jitbyoc bug" in miss


# Module-level state that functions change, each with the reason it may exist. A build's
# own state lives in its session (jitbyoc.toolchain.session); what is left is a registry
# filled once at import, a bounded and locked cache, a process-wide switch or resource,
# or a scope one thread sets around its own work.
ALLOWED_STATE = {
    ("jitbyoc.ir.rules", "RULES"): "registry, filled at import",
    ("jitbyoc.ir.rules", "REWRITES"): "registry, filled at import",
    ("jitbyoc.engines.registry", "KINDS"): "registry, filled at import",
    ("jitbyoc.kernels", "FAILED"): "registry, filled at import",
    ("jitbyoc.tvm.patterns", "OPS_USED"): "registry, filled at import",
    ("jitbyoc.toolchain.cache", "_MEMORY"): "cache (memo.LRU: bounded, locked)",
    ("jitbyoc.toolchain.driver", "_MODULES"): "cache (memo.LRU: bounded, locked)",
    ("jitbyoc.tvm.partition", "_MEMO"): "cache (memo.LRU: bounded, locked)",
    ("jitbyoc.profile", "_WORK"): "cache (memo.LRU: bounded, locked)",
    ("jitbyoc.tvm.lift_te", "_LEGALIZED"): "cache (memo.LRU: bounded, locked)",
    ("jitbyoc.toolchain.cache", "_SIZES"): "cache: each cache root's size on disk, under its lock",
    ("jitbyoc.toolchain.cache", "_WARNED"): "the warnings already given, under the cache's lock",
    ("jitbyoc.toolchain.cache", "SETTINGS"): "the user's process-wide cache settings (jitbyoc.cache.configure)",
    ("jitbyoc.toolchain.compile_worker", "_LSR"): "cache: whether this LLVM has the pass, found once",
    ("jitbyoc.toolchain.compile_pool", "_POOL"): "the process's compile workers, made once under a lock",
    ("jitbyoc.tvm.hook", "_STATE"): "the process-wide switch (enable/disable), under a lock, as TVM's pipelines are",
    ("jitbyoc.tvm.constants", "_WRITING"): "the weight copies in flight, by address, under a lock",
    ("jitbyoc.toolchain.session", "_SESSIONS"): "the builds under way, for RunCodegen's callback, under a lock",
    ("jitbyoc.render.isa", "_CURRENT"): "scope: the machine one thread's session plans and renders for",
    ("jitbyoc.ir.relax_types", "_SIZES"): "scope: the symbolic sizes of the region one thread lowers",
    ("jitbyoc.tvm.constants", "_DEFERRED"): "scope: the constants one thread's prepare() defers",
}
_MUTATORS = {"append", "update", "setdefault", "pop", "clear", "put", "add", "extend", "insert", "remove",
             "discard", "popitem", "set", "move_to_end"}


def _root_name(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _changed_state(path: pathlib.Path) -> set[str]:
    """Module-level names of ``path`` that a function changes (stores into, calls a
    mutating method of, rebinds with ``global``), or that are thread or context scopes."""
    tree = ast.parse(path.read_text())
    top: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            top.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            top[node.target.id] = node.value
    found = {n for n, v in top.items() if re.search(r"\b(ContextVar|local)\(", ast.unparse(v))}
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                found.update(n.names)
            elif isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, (ast.Store, ast.Del)):
                found.add(_root_name(n.value))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _MUTATORS:
                found.add(_root_name(n.func.value))
    return {n for n in found if n in top}


def test_no_module_level_mutable_state_outside_the_caches_and_the_session():
    found = {(_module(p), name) for p in ROOT.rglob("*.py") for name in _changed_state(p)}
    assert found - ALLOWED_STATE.keys() == set(), "a build's state belongs in its session"
    assert ALLOWED_STATE.keys() - found == set(), "stale entries in ALLOWED_STATE"


def test_patterns_name_no_op():
    """Which ops make composites is the rules' business (Rule.composite), not the patterns'."""
    tree = ast.parse((ROOT / "tvm" / "patterns.py").read_text())
    named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.match(r"relax\.\w", n.value)]
    assert named == []


def test_no_regex_over_generated_text_finds_engines():
    """Which engines code calls is a value (read from its rendered module's declarations
    and cached with its assembly: runtime.Code.calls), never searched for in IR or
    assembly text."""
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "re":
                text = ast.unparse(node)
                if "PREFIX" in text or "jitbyoc_lib" in text:
                    found.append(f"{_module(path)}: {text}")
    assert found == []


def test_what_the_engines_multiply_is_written_once():
    """The element types the heavy engines compute in come from one table
    (jitbyoc.engines.products), not from a tuple of dtypes repeated in each engine, kernel
    and packer (six copies before)."""
    found = []
    for path in ROOT.rglob("*.py"):
        if _module(path) in ("jitbyoc.engines.products", "jitbyoc.ir.dtypes"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and {"float32", "float64"} <= {
                    e.value for e in node.elts if isinstance(e, ast.Constant)}:
                found.append(f"{_module(path)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []

"""Differential-testing helpers for the layout, reduction and normalization kernels.

A grid of independent cases becomes ONE BlockBuilder model (one TVM build and one jitbyoc
build cover the grid); every output is compared with TVM's default build and, where the
test gives one, a numpy reference. :func:`run_c` runs a region's C rendering, compiled
with the system C compiler, on the same inputs.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

import jitbyoc
from jitbyoc.render import isa
from jitbyoc.tvm.partition import partition_for_jitbyoc
from jitbyoc.tvm.target import machine_for
from tests.conftest import output_shapes

CC = shutil.which("cc")


def model(cases, make, sym=()):
    """``main(inputs of case 0, inputs of case 1, ...) -> (outputs...)``.

    ``cases`` is a list of ``(shapes, attrs)`` where ``shapes`` is a list of
    ``(shape, dtype)``; a shape may name symbolic dims listed in ``sym``.
    ``make(bb, vars, attrs)`` emits the case and returns its output var(s).
    """
    tir_vars = {name: tvm.tirx.Var(name, "int64") for name in sym}
    bb = relax.BlockBuilder()
    params, groups = [], []
    for k, (shapes, _) in enumerate(cases):
        vs = [relax.Var(f"c{k}_{i}", relax.TensorType([tir_vars.get(d, d) for d in s], dt))
              for i, (s, dt) in enumerate(shapes)]
        params += vs
        groups.append(vs)
    with bb.function("main", params):
        with bb.dataflow():
            outs = []
            for vs, (_, attrs) in zip(groups, cases):
                got = make(bb, vs, attrs)
                outs += list(got) if isinstance(got, (list, tuple)) else [got]
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(out)
    return bb.get()


def build(mod, offload: bool):
    with (jitbyoc.enabled() if offload else jitbyoc.disabled()):
        return tvm.compile(mod, target="llvm")


def run(ex, arrays) -> list[np.ndarray]:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
    if isinstance(out, tvm.runtime.Tensor):
        return [out.numpy()]
    return [o.numpy() for o in out]


def inputs(cases, sizes=None, seed=0, low=None) -> list[np.ndarray]:
    """Random inputs for ``cases``; symbolic dims take their value from ``sizes``."""
    rng = np.random.default_rng(seed)
    out = []
    for shapes, _ in cases:
        for s, dt in shapes:
            shape = [sizes[d] if isinstance(d, str) else d for d in s]
            if dt.startswith("int"):
                out.append(rng.integers(-50, 50, shape).astype(dt))
            elif dt == "bool":
                out.append(rng.random(shape) < 0.5)
            else:
                out.append(rng.standard_normal(shape).astype(dt))
    return out


def both(mod, arrays):
    """(jitbyoc results, TVM default results)."""
    return run(build(mod, True), arrays), run(build(mod, False), arrays)


def one_region(mod):
    """Assert ``mod`` is offloaded whole, as one region; returns that region's info."""
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [], str(rep)
    assert len(rep.regions) == 1, str(rep)
    return rep.regions[0]


def run_c(region, arrays: dict, tmp_path) -> list[np.ndarray]:
    """Compile ``region.c_source`` into a shared library and call the region's symbol with
    ``arrays`` (by the region's argument names); returns its outputs."""
    src, lib = tmp_path / f"{region.symbol}.c", tmp_path / f"{region.symbol}.so"
    src.write_text(region.c_source)
    subprocess.run([CC, "-O2", "-ffp-contract=off", "-shared", "-fPIC", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    kernel = region.kernel
    ins = [arrays[n] for n in region.arg_names[:len(kernel.inputs)]]
    outs = [tvm.runtime.empty(shape, b.dtype) for b, shape in zip(kernel.outputs, output_shapes(kernel, ins))]
    mod = tvm.runtime.load_module(str(lib))
    mod[region.symbol](*[tvm.runtime.tensor(a) for a in ins], *outs)
    return [o.numpy() for o in outs]


def region_constants(mod, target) -> dict:
    """The constants jitbyoc passes its (single) region, as the region names its inputs
    (``const<k>``: the call's k-th argument): partitioned again for ``target``'s machine,
    which packs weights for its vectors (or tiles)."""
    with isa.compiling_for(machine_for(target)):
        part = partition_for_jitbyoc(mod)
    calls = [b.value for block in part["main"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)]
    return {f"const{k}": a.value.numpy() for call in calls for k, a in enumerate(call.args)
            if isinstance(a, Constant)}


def check_c_matches_llvm(mod, arrays, tmp_path, rtol=0.0, atol=0.0) -> None:
    """Every region's C rendering gives what the JIT'd code gives (the model must be one
    region whose parameters are the model's own inputs)."""
    (region,) = jitbyoc.inspect(mod)
    names = [p.name for p in mod["main"].params]
    got_c = run_c(region, dict(zip(names, arrays)), tmp_path)
    got = run(build(mod, True), arrays)
    assert len(got_c) == len(got)
    for c, j in zip(got_c, got):
        np.testing.assert_allclose(c, j, rtol=rtol, atol=atol)

"""Helpers shared by test_kernel_conv and test_kernel_pool: build a BlockBuilder model
of many independent ops (one TVM build covers a whole grid), run it with and without
jitbyoc, and run one region's C rendering compiled with the system C compiler."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import tvm
from tvm import relax

import jitbyoc

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


def build(mod, offload: bool):
    with (jitbyoc.enable() if offload else jitbyoc.disable()):
        return tvm.compile(mod, target="llvm")


def run(ex, arrays) -> list[np.ndarray]:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
    if isinstance(out, tvm.runtime.Tensor):
        return [out.numpy()]
    return [o.numpy() for o in out]


def random_inputs(cases, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(d) for shapes, _ in cases for s, d in shapes]


def run_c(region, inputs: dict[str, np.ndarray], out_shape, dtype, tmp_path) -> np.ndarray:
    """Compile ``region.c_source`` as a shared library and call it on ``inputs`` (by the
    region's argument names); returns its single output."""
    src, lib = tmp_path / f"{region.symbol}.c", tmp_path / f"{region.symbol}.so"
    src.write_text(region.c_source)
    subprocess.run([CC, "-O2", "-ffp-contract=off", "-shared", "-fPIC", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    mod = tvm.runtime.load_module(str(lib))
    out = tvm.runtime.empty(out_shape, dtype)
    args = [tvm.runtime.tensor(inputs[n]) for n in region.arg_names[:-1]]
    mod[region.symbol](*args, out)
    return out.numpy()

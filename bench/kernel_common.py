"""Pieces the per-kernel benchmarks (``bench/kernels_*.py``) share."""

from __future__ import annotations


def module(params, body):
    """``main(*params)`` whose dataflow block returns ``body(bb, *vars)``.

    Parameters
    ----------
    params : list
        ``(name, shape)`` pairs (float32), or numpy arrays (named ``p0``, ``p1``... with
        their own shapes and dtypes).
    body : callable
        ``body(bb, *vars)`` -> the output expression.
    """
    from tvm import relax

    specs = [(f"p{k}", p.shape, str(p.dtype)) if hasattr(p, "shape") else (p[0], p[1], "float32")
             for k, p in enumerate(params)]
    bb = relax.BlockBuilder()
    vs = [relax.Var(name, relax.TensorType(shape, dtype)) for name, shape, dtype in specs]
    with bb.function("main", vs):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *vs))
        bb.emit_func_output(out)
    return bb.get()


def vm_function(mod, offload: bool, args):
    """A no-argument callable running ``mod`` built by jitbyoc (``offload``) or by TVM's
    default pipeline, on ``args`` converted once."""
    import tvm
    from tvm import relax

    from . import target as build_target

    f = relax.VirtualMachine(build_target.build(mod, offload), tvm.cpu())["main"]
    tensors = [tvm.runtime.tensor(a) for a in args]
    return lambda: f(*tensors)

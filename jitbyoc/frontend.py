"""Relax region -> kernel IR.

A region is a function of composite calls. Elementwise ops become expression nodes and
are never materialized; each region output is stored by an :class:`~jitbyoc.kir.Elementwise`
stage, one per distinct output shape, so outputs of one shape share a loop nest and
every value they have in common is computed once per point.
"""

from __future__ import annotations

import re

from tvm import relax

from . import kir
from .ops import OPS, RELAX_OPS
from .patterns import _attrs, dims


class LoweringError(RuntimeError):
    """A region could not be lowered; names the region and the binding."""


def _c_name(text: str) -> str:
    return re.sub(r"\W", "_", text)


class RegionLowering:
    def __init__(self, func: relax.Function, symbol: str):
        self.symbol = symbol
        self.func = func
        self.env: dict = {}
        self.local: dict = {}
        self.kernel = kir.Kernel(symbol, [], [])
        self.arg_names: list[str] = []

    def value(self, expr):
        if isinstance(expr, relax.Var):
            return self.env[expr]
        if isinstance(expr, relax.Constant) and expr.data.shape == ():
            return kir.Const(expr.data.numpy().item(), str(expr.data.dtype))
        raise LoweringError(f"{self.symbol}: cannot lower operand {type(expr).__name__}")

    def op(self, call: relax.Call, out_ty):
        name = RELAX_OPS[call.op.name]
        operands = call.args[:1] if name == "clip" else call.args
        args = tuple(self.value(a) for a in operands)
        in_dtype = args[-1].dtype if name == "where" else args[0].dtype
        attrs = tuple(sorted(_attrs(call).items()))
        self.kernel.ops.append(call.op.name)
        return kir.Op(name, args, in_dtype, str(out_ty.dtype), attrs)

    def composite(self, inner: relax.Function, args):
        for p, a in zip(inner.params, args):
            self.env[p] = self.value(a)
        result = None
        for block in inner.body.blocks:
            for binding in block.bindings:
                result = self.env[binding.var] = self.op(binding.value, binding.var.ty)
        return self.env[inner.body.body] if isinstance(inner.body.body, relax.Var) else result

    def lower(self) -> tuple[kir.Kernel, list[str]]:
        for i, p in enumerate(self.func.params):
            buf = kir.Buffer(f"in{i}_{_c_name(p.name)}"[:48], tuple(dims(p.ty)), str(p.ty.dtype))
            self.kernel.inputs.append(buf)
            self.arg_names.append(p.name)
            self.env[p] = kir.Load(buf)
        for block in self.func.body.blocks:
            for b in block.bindings:
                v = b.value
                if isinstance(v, relax.Function):
                    self.local[b.var] = v
                elif isinstance(v, relax.Call) and v.op in self.local:
                    self.env[b.var] = self.composite(self.local[v.op], v.args)
                elif isinstance(v, relax.TupleGetItem):
                    self.env[b.var] = self.env[v.tuple_value][v.index]
                elif isinstance(v, relax.Tuple):
                    self.env[b.var] = tuple(self.value(f) for f in v.fields)
                else:
                    raise LoweringError(f"{self.symbol}: unexpected binding {b.var.name} = "
                                        f"{type(v).__name__}")
        body = self.func.body.body
        results = body.fields if isinstance(body, relax.Tuple) else [body]
        by_shape: dict[tuple, list] = {}
        for k, r in enumerate(results):
            buf = kir.Buffer(f"out{k}", tuple(dims(r.ty)), str(r.ty.dtype))
            self.kernel.outputs.append(buf)
            self.arg_names.append(f"output{k}")
            by_shape.setdefault(buf.shape, []).append((buf, self.value(r)))
        for shape, stores in by_shape.items():
            self.kernel.stages.append(kir.Elementwise(shape, tuple(stores)))
        return self.kernel, self.arg_names


def lower_region(func: relax.Function) -> tuple[kir.Kernel, list[str]]:
    """Lower one partitioned region to a kernel and the names of its arguments."""
    symbol = str(func.attrs["global_symbol"])
    try:
        return RegionLowering(func, symbol).lower()
    except LoweringError:
        raise
    except Exception as err:
        raise LoweringError(f"jitbyoc: lowering region '{symbol}' failed: "
                            f"{type(err).__name__}: {err}") from err

"""Library engines: heavy kernels compiled once per machine and shared by every region.

A convolution or matrix product specialized to one layer's sizes is ~150 KB of LLVM IR
and ~150 ms of LLVM time; ResNet-18 has 20 of them. A library engine takes its sizes,
strides and tables at run time, so one compiled engine serves every layer with the same
*template* (dtype, register blocking): ResNet-18 needs two conv engines and one GEMM.
A region's own code is then glue: argument checks, fused epilogues (called back by the
engine through a function pointer, see :meth:`jitbyoc.render.llvm.Ctx.outline`), and
the call. Engines may call engines (a GEMM engine its microkernels, :class:`.gemm_micro.Micro`).

An engine is a frozen dataclass registered with :func:`kind`; its fields are its
template, and its symbol ``jitbyoc_lib_<kind>_<field values>`` names it completely, so
any process can rebuild it from the name (:func:`jitbyoc.engines.parse`). Which engines a
region or an engine calls is read from its rendered module's declarations (:func:`used_by`)
and cached with its assembly, never searched for in generated text. Engines are compiled
and cached like regions (:mod:`jitbyoc.toolchain.driver`) and go into each build's runtime
module once, next to the regions that call them.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from llvmlite import ir

from ..ir import kir
from ..ir.llvmtypes import I32, I64, PTR, declare
from ..render.llvm import Ctx, load_slots, pack_slots, release
from ..render.optimization import Pipeline

PREFIX = "jitbyoc_lib_"
KINDS: dict[str, type] = {}


class Engine:
    """Base of library engines (subclasses are frozen dataclasses of int/str fields)."""
    kind: ClassVar[str]
    # Written with explicit vectors and register blocks: the vectorizers find nothing to
    # do, and O2 or strength reduction changed no model's run time (ResNet-18's convs).
    # The lean pass list would halve the conv engines' compile but cost ResNet-18 1.8 %.
    pipeline: ClassVar[Pipeline] = Pipeline(speed_level=1, vectorize=False, lsr=False)

    @property
    def symbol(self) -> str:
        return PREFIX + "_".join([self.kind] + [str(getattr(self, f.name)) for f in fields(self)])

    def signature(self) -> ir.FunctionType:
        """``i32 engine(ptr params)``: params is an array of i64 slots; 0 or -1 (error set)."""
        return ir.FunctionType(I32, [PTR])

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define emit")


def kind(cls):
    """Class decorator registering an :class:`Engine` subclass under ``cls.kind``."""
    assert "_" not in cls.kind, "engine kinds are single words (they are parsed from symbols)"
    KINDS[cls.kind] = cls
    return cls


def use(module: ir.Module, engine: Engine) -> ir.Function:
    """Declare ``engine`` in a region's module; returns the function to call."""
    sig = engine.signature()
    return declare(module, engine.symbol, sig.return_type, list(sig.args))


def call(ctx, engine: Engine, slots: list) -> None:
    """Call ``engine`` with ``slots`` (i64 values or ints) from ``ctx``; an error return
    (TVM's error already set) returns -1 from the region at once."""
    b = ctx.b
    rc = b.call(use(ctx.module, engine), [pack_slots(b, slots)])
    with b.if_then(b.icmp_signed("!=", rc, I32(0)), likely=False):
        b.ret(I32(-1))


def open_params(engine: Engine, module: ir.Module, fn: ir.Function, names, buffers, dtype):
    """The emit context of an ``i32 engine(ptr params)``: slot ``i`` of ``params`` is
    ``names[i]``; the names in ``buffers`` are pointers to ``dtype`` buffers (a dtype,
    or a dict from name to dtype), returned as ``kir.Buffer`` objects; the rest are sizes
    (``ctx.syms``)."""
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    vals = dict(zip(names, load_slots(b, fn.args[0], len(names))))
    bufs = {x: kir.Buffer(x, (), dtype if isinstance(dtype, str) else dtype[x]) for x in buffers}
    ctx = Ctx(module, b, engine.symbol, {bufs[x]: b.inttoptr(vals[x], PTR) for x in bufs},
              {k: v for k, v in vals.items() if k not in bufs})
    return ctx, bufs


def call_back(b: ir.IRBuilder, fn, env, args: list) -> None:
    """Call a region's callback ``fn`` (an i64 address, made by ``Ctx.outline(kind,
    len(args), body)``) with its ``env`` and the i64 ``args``."""
    callback = ir.FunctionType(ir.VoidType(), [PTR] + [I64] * len(args))
    b.call(b.inttoptr(fn, ir.PointerType(callback)), [b.inttoptr(env, PTR)] + list(args))


def emitted(engine: Engine, triple: str, data_layout: str) -> tuple[str, set[str]]:
    """The engine's LLVM IR, and the names with the engine prefix its module holds besides
    its own (the engines it calls, and its helpers: see :func:`jitbyoc.engines.emit`)."""
    module = ir.Module(name=engine.symbol)
    module.triple, module.data_layout = triple, data_layout
    engine.emit(module, ir.Function(module, engine.signature(), engine.symbol))
    text, named = str(module), used_by(module) - {engine.symbol}
    release(module)
    return text, named


def ir_text(engine: Engine, triple: str, data_layout: str) -> str:
    """The engine's LLVM IR."""
    return emitted(engine, triple, data_layout)[0]


def used_by(module: ir.Module) -> set[str]:
    """The names with the engine prefix a rendered module holds: the engines a region's
    module declares (read from the module's globals, never from its text)."""
    return {name for name in module.globals if name.startswith(PREFIX)}

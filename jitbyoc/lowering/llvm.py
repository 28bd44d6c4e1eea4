"""Kernel IR -> LLVM IR (llvmlite.ir): a compute function and its packed-function entry."""

from __future__ import annotations

import math
from functools import reduce

import numpy as np
from llvmlite import ir

from .. import kir
from ..dtypes import dtype as lookup_dtype
from ..ops import op_def
from . import abi
from .loops import I64, loop_nest

I8, I32 = ir.IntType(8), ir.IntType(32)
PTR = ir.PointerType()


class Emitter:
    """Emits table ops through the llvmlite builder (the interface expansions use)."""

    def __init__(self, b: ir.IRBuilder):
        self.b = b

    def const(self, value, dt: str):
        d = lookup_dtype(dt)
        if d.is_float:
            value = float(value)
            if d.bits == 32 and math.isfinite(value):
                value = float(np.float32(value))
            return ir.Constant(d.ir, value)
        return ir.Constant(d.ir, int(bool(value)) if d.is_bool else int(value))

    def op(self, name: str, dt: str, *args, **attrs):
        row = op_def(name, dt)
        if row.expand is not None:
            return row.expand(self, dt, *args, **attrs)
        return row.llvm(self.b, lookup_dtype(dt), *args, **attrs)


def product(b: ir.IRBuilder, dims, syms: dict):
    """The product of ``dims`` (ints and symbolic names) as an i64 value."""
    static = reduce(lambda x, y: x * y, (d for d in dims if isinstance(d, int)), 1)
    acc = ir.Constant(I64, static)
    for d in dims:
        if isinstance(d, str):
            acc = b.mul(acc, syms[d], flags=["nsw"])
    return acc


def emit_elementwise(b: ir.IRBuilder, stage: kir.Elementwise, ptrs: dict, syms: dict):
    roots = [node for _, node in stage.stores]
    bufs = kir.loads(roots) + [buf for buf, _ in stage.stores]
    layout = kir.nest_layout(stage.shape, bufs)
    counts = [product(b, ext, syms) for ext in layout.extents]
    steps = {buf: [None if s is None else product(b, s, syms) for s in layout.strides[buf]]
             for buf in bufs}
    em = Emitter(b)
    with loop_nest(b, counts) as idx:
        def address(buf):
            off = ir.Constant(I64, 0)
            for i, step in zip(idx, steps[buf]):
                if step is not None:
                    off = b.add(off, b.mul(i, step, flags=["nsw"]), flags=["nsw"])
            return b.gep(ptrs[buf], [off], source_etype=lookup_dtype(buf.dtype).storage_ir,
                         inbounds=True)

        values = {}
        for node in kir.walk(roots):
            if isinstance(node, kir.Load):
                d = lookup_dtype(node.dtype)
                v = b.load(address(node.buf), typ=d.storage_ir)
                values[id(node)] = b.icmp_unsigned("!=", v, ir.Constant(I8, 0)) if d.is_bool else v
            elif isinstance(node, kir.Const):
                values[id(node)] = em.const(node.value, node.dtype)
            else:
                values[id(node)] = em.op(node.op, node.in_dtype, *(values[id(a)] for a in node.args),
                                         **node.kwargs)
        for buf, node in stage.stores:
            v = values[id(node)]
            if lookup_dtype(buf.dtype).is_bool:
                v = b.zext(v, I8)
            b.store(v, address(buf))


STAGE_EMITTERS = {kir.Elementwise: emit_elementwise}


def emit_compute(module: ir.Module, kernel: kir.Kernel) -> ir.Function:
    syms = kernel.sym_vars
    fnty = ir.FunctionType(ir.VoidType(), [PTR] * len(kernel.params) + [I64] * len(syms))
    fn = ir.Function(module, fnty, f"{kernel.name}_compute")
    fn.linkage = "internal"
    for arg, buf in zip(fn.args, kernel.params):
        arg.name = buf.name
        arg.add_attribute("noalias")
    for arg, s in zip(fn.args[len(kernel.params):], syms):
        arg.name = s
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ptrs = dict(zip(kernel.params, fn.args))
    symvals = dict(zip(syms, fn.args[len(kernel.params):]))
    for stage in kernel.stages:
        STAGE_EMITTERS[type(stage)](b, stage, ptrs, symvals)
    b.ret_void()
    return fn


# ---- the packed-function entry -----------------------------------------------------------

def _cstring(module: ir.Module, text: str) -> ir.GlobalVariable:
    data = bytearray(text.encode()) + b"\0"
    name = f".str.{len(module.globals)}"
    g = ir.GlobalVariable(module, ir.ArrayType(I8, len(data)), name)
    g.global_constant, g.linkage, g.unnamed_addr = True, "private", True
    g.initializer = ir.Constant(ir.ArrayType(I8, len(data)), data)
    return g


def _declare(module, name, ret, args, var_arg=False):
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args, var_arg), name)


def _field(b, base, offset, ty):
    return b.load(b.gep(base, [ir.Constant(I64, offset)], source_etype=I8), typ=ty)


def emit_entry(module: ir.Module, kernel: kir.Kernel, compute: ir.Function, arg_names: list[str]):
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, I32, PTR]), f"__tvm_ffi_{kernel.name}")
    _, args, nargs, _ = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    msgbuf = b.alloca(ir.ArrayType(I8, 1024), name="msg")
    snprintf = _declare(module, "snprintf", I32, [PTR, I64, PTR], var_arg=True)
    raise_ = _declare(module, "TVMFFIErrorSetRaisedFromCStr", ir.VoidType(), [PTR, PTR])
    kind = _cstring(module, "ValueError")

    def fail_if(pred, message, *values):
        with b.if_then(pred, likely=False):
            b.call(snprintf, [msgbuf, ir.Constant(I64, 1024), _cstring(module, message), *values])
            b.call(raise_, [kind, msgbuf])
            b.ret(ir.Constant(I32, -1))

    dls, syms = {}, {}
    for chk in abi.plan(kernel, arg_names):
        if isinstance(chk, abi.ArgCount):
            fail_if(b.icmp_signed("!=", nargs, ir.Constant(I32, chk.expected)), chk.message, nargs)
        elif isinstance(chk, abi.Unpack):
            slot = b.gep(args, [ir.Constant(I64, chk.index * abi.ANY_SIZE)], source_etype=I8)
            tindex = b.load(slot, typ=I32)
            value = _field(b, slot, 8, PTR)
            is_tensor = b.icmp_signed("==", tindex, ir.Constant(I32, abi.TYPE_TENSOR))
            is_dl = b.icmp_signed("==", tindex, ir.Constant(I32, abi.TYPE_DLTENSOR_PTR))
            fail_if(b.not_(b.or_(is_tensor, is_dl)), chk.message, tindex)
            shifted = b.gep(value, [ir.Constant(I64, abi.TENSOR_DLTENSOR_OFFSET)], source_etype=I8)
            dls[chk.index] = b.select(is_tensor, shifted, value)
        elif isinstance(chk, abi.FieldEq):
            ty = ir.IntType(chk.bits)
            got = _field(b, dls[chk.index], chk.offset, ty)
            shown = [got if mask < 0 else b.and_(b.lshr(got, ty(shift)), ty(mask)) for shift, mask in chk.parts]
            fail_if(b.icmp_signed("!=", got, ir.Constant(ty, chk.expected)), chk.message, *shown)
        elif isinstance(chk, abi.DimEq):
            shape = _field(b, dls[chk.index], abi.DL_SHAPE, PTR)
            got = b.load(b.gep(shape, [ir.Constant(I64, chk.axis)], source_etype=I64), typ=I64)
            if chk.binds:
                syms[chk.expected] = got
            elif isinstance(chk.expected, str):
                want = syms[chk.expected]
                fail_if(b.icmp_signed("!=", got, want), chk.message, got, want)
            else:
                fail_if(b.icmp_signed("!=", got, ir.Constant(I64, chk.expected)), chk.message, got)
        elif isinstance(chk, abi.Contiguous):
            _emit_contiguous(b, dls[chk.index], kernel.params[chk.index], syms, fail_if, chk.message)
    ptrs = []
    for i in range(len(kernel.params)):
        data = _field(b, dls[i], abi.DL_DATA, PTR)
        ptrs.append(b.gep(data, [_field(b, dls[i], abi.DL_BYTE_OFFSET, I64)], source_etype=I8))
    b.call(compute, ptrs + [syms[s] for s in kernel.sym_vars])
    b.ret(ir.Constant(I32, 0))
    return fn


def _emit_contiguous(b, dl, buf: kir.Buffer, syms, fail_if, message):
    strides = _field(b, dl, abi.DL_STRIDES, PTR)
    has = b.icmp_unsigned("!=", b.ptrtoint(strides, I64), ir.Constant(I64, 0))
    with b.if_then(has):
        for axis in range(buf.ndim):
            if buf.shape[axis] == 1:
                continue
            got = b.load(b.gep(strides, [ir.Constant(I64, axis)], source_etype=I64), typ=I64)
            want = product(b, buf.shape[axis + 1:], syms)
            bad = b.icmp_signed("!=", got, want)
            if isinstance(buf.shape[axis], str):  # a symbolic size may be 1 at run time
                bad = b.and_(bad, b.icmp_signed("!=", syms[buf.shape[axis]], ir.Constant(I64, 1)))
            fail_if(bad, message, ir.Constant(I32, axis), got, want)


def emit_llvm(kernel: kir.Kernel, arg_names: list[str], triple: str, data_layout: str) -> ir.Module:
    """The kernel as an llvmlite module: ``<name>_compute`` plus ``__tvm_ffi_<name>``."""
    module = ir.Module(name=kernel.name)
    module.triple, module.data_layout = triple, data_layout
    compute = emit_compute(module, kernel)
    emit_entry(module, kernel, compute, arg_names)
    return module

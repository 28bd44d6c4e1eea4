"""The packed-function entry in LLVM IR: walks :func:`jitbyoc.lowering.abi.plan`."""

from __future__ import annotations

from llvmlite import ir

from .. import kir
from . import abi
from .llvm import I8, I32, I64, PTR, declare, product


def _cstring(module: ir.Module, text: str) -> ir.GlobalVariable:
    data = bytearray(text.encode()) + b"\0"
    name = f".str.{len(module.globals)}"
    g = ir.GlobalVariable(module, ir.ArrayType(I8, len(data)), name)
    g.global_constant, g.linkage, g.unnamed_addr = True, "private", True
    g.initializer = ir.Constant(ir.ArrayType(I8, len(data)), data)
    return g


def _field(b, base, offset, ty):
    return b.load(b.gep(base, [ir.Constant(I64, offset)], source_etype=I8), typ=ty)


def emit_entry(module: ir.Module, kernel: kir.Kernel, compute: ir.Function, arg_names: list[str]):
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, I32, PTR]), f"__tvm_ffi_{kernel.name}")
    _, args, nargs, _ = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    msgbuf = b.alloca(ir.ArrayType(I8, 1024), name="msg")
    snprintf = declare(module, "snprintf", I32, [PTR, I64, PTR], var_arg=True)
    raise_ = declare(module, "TVMFFIErrorSetRaisedFromCStr", ir.VoidType(), [PTR, PTR])
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
    b.ret(b.call(compute, ptrs + [syms[s] for s in kernel.sym_vars]))
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

"""The packed-function entry in LLVM IR: the checks of :func:`jitbyoc.lowering.abi.plan`
as a table, run by the shared argument engine (:mod:`.args_engine`), then the compute call."""

from __future__ import annotations

from llvmlite import ir

from .. import kir, library
from . import args_engine
from .llvm import I32, I64, PTR


def emit_entry(module: ir.Module, kernel: kir.Kernel, compute: ir.Function, arg_names: list[str]):
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, I32, PTR]), f"__tvm_ffi_{kernel.name}")
    _, args, nargs, _ = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    nparams, nsyms = len(kernel.params), len(kernel.sym_vars)
    out = b.alloca(I64, size=nparams + nsyms, name="out")  # data pointers, then symbolic sizes
    table = args_engine.table(module, kernel, arg_names)
    rc = b.call(library.use(module, args_engine.ArgsEngine()), [args, nargs, table, out])
    with b.if_then(b.icmp_signed("!=", rc, I32(0)), likely=False):
        b.ret(I32(-1))
    values = [b.load(b.gep(out, [I64(k)], source_etype=I64), typ=PTR if k < nparams else I64)
              for k in range(nparams + nsyms)]
    b.ret(b.call(compute, values))
    return fn

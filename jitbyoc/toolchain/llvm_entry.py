"""The region's entry in LLVM IR: the checks of :func:`jitbyoc.render.abi.plan` as a
table, run by the shared argument engine (:mod:`jitbyoc.engines.args`), then the compute call.

``i32 <name>_entry(ptr self, ptr args, i32 n, ptr ret, ptr names)`` is TVM's packed
function ABI plus the names table of the use that calls it: each use of the code gets a
one-call trampoline ``__tvm_ffi_<symbol>`` with its own table (see
:mod:`jitbyoc.toolchain.runtime`), so the compiled code holds no user text and is shared.
"""

from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir

from ..engines import args as args_engine
from ..engines import registry
from ..ir import kir, sizes
from ..ir.errors import RenderError, error_context
from ..ir.llvmtypes import I32, I64, PTR
from ..render.llvm import Facts, emit_compute

ENTRY_SUFFIX = "_entry"


def entry_symbol(code_symbol: str) -> str:
    return code_symbol + ENTRY_SUFFIX


class Rendered(NamedTuple):
    module: ir.Module
    facts: Facts


def emit_llvm(kernel: kir.Kernel, triple: str, data_layout: str) -> Rendered:
    """The kernel as an llvmlite module (``<name>_compute`` plus ``<name>_entry``) and
    what rendering it found out."""
    module = ir.Module(name=kernel.name)
    module.triple, module.data_layout = triple, data_layout
    compute, facts = emit_compute(module, kernel)
    with error_context(RenderError, kernel.name, "its entry (the argument checks) in LLVM"):
        emit_entry(module, kernel, compute)
    return Rendered(module, facts)


def emit_entry(module: ir.Module, kernel: kir.Kernel, compute: ir.Function):
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, I32, PTR, PTR]), entry_symbol(kernel.name))
    _, args, nargs, _, names = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    nparams, nsyms = len(kernel.params), len(kernel.sym_vars)
    out = b.alloca(I64, size=nparams + nsyms, name="out")  # data pointers, then symbolic sizes
    engine = registry.use(module, args_engine.ArgsEngine())
    bind, derive, check = args_engine.tables(module, kernel)
    _walk(b, engine, [args, nargs, bind, out, names])
    if check is not None:  # derived sizes, from the plain ones the first walk bound
        slot = {s: b.gep(out, [I64(nparams + k)], source_etype=I64) for k, s in enumerate(kernel.sym_vars)}
        plain = {s: b.load(slot[s], typ=I64) for s in kernel.plain_sizes}
        for d in derive:
            b.store(sizes.emit_llvm(b, d.tree, plain), slot[d.name])
        _walk(b, engine, [args, nargs, check, out, names])
    values = [b.load(b.gep(out, [I64(k)], source_etype=I64), typ=PTR if k < nparams else I64)
              for k in range(nparams + nsyms)]
    b.ret(b.call(compute, values))
    return fn


def _walk(b: ir.IRBuilder, engine: ir.Function, operands: list) -> None:
    """One walk of the argument engine over a table; its error returns at once."""
    rc = b.call(engine, operands)
    with b.if_then(b.icmp_signed("!=", rc, I32(0)), likely=False):
        b.ret(I32(-1))

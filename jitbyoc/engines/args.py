"""The argument checks of every region's entry as data, run by one shared library engine.

Rendered inline, the checks of :func:`jitbyoc.render.abi.plan` cost a compare, a
``snprintf`` and a raise per check: 250-450 instructions and 15-30 ms of LLVM time in
every region. Instead a region encodes its plan as a table (:func:`table`) and calls
``i32 jitbyoc_lib_args(ptr args, i32 nargs, ptr table, ptr out, ptr names)``, compiled once
per machine (:mod:`jitbyoc.engines`). It returns 0, or -1 with a ``ValueError`` set.

The table is one private constant ``{ [n x i64], [m x i8] }``: the number of records,
then the records, then the messages (NUL-terminated printf formats, jitbyoc's text
only). A record is nine i64 words ``op, arg, x, y, msg, show, s0, s1, s2``; ``msg`` is
the byte offset of its message from the start of the table, so the table needs no
relocations; ``s0..s2`` index strings of ``names``, the names table of this use of the
region (:func:`jitbyoc.render.abi.names_table`: i64 offsets, then the strings), which
the messages print with ``%s`` (the order of each op's values: see :mod:`.abi`). The
user's names live only there, as data. ``out`` has one i64 slot per argument, then one
per symbolic size (``kernel.sym_vars`` order). By op:

=========  ===========================================================================
COUNT      ``nargs == y``; prints nargs
UNPACK     argument ``arg`` is a Tensor or a DLTensor*: its DLTensor* goes to out[arg];
           prints the FFI type index
FIELD      the i32 field at byte ``x`` of the DLTensor equals ``y``; prints up to three
           parts of the field: ``show`` holds one 16-bit (shift, width) pair per part,
           shift in the low byte (width 32: all of it, 0: no part)
DIM        ``shape[x] == y``; prints shape[x]
BIND       ``out[y] = shape[x]`` (first sight of a symbolic size)
DIM_SYM    ``shape[x] == out[y]``; prints both
CONTIG     null strides, or compact ones for ``x`` dims; prints axis, stride, expected
DATA       ``out[arg]`` = the DLTensor's data pointer plus its byte offset
=========  ===========================================================================

CONTIG computes the compact strides from the tensor's own shape: the DIM checks before
it made that shape the buffer's, int or symbolic. A dim of 1 (a symbolic size that is 1
at run time too) has no stride to check, as in :mod:`jitbyoc.toolchain.c_entry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..ir import kir
from ..ir.llvmtypes import I8, I32, I64, PTR, declare
from ..render import abi
from ..render.abi import BIND, CONTIG, COUNT, DATA, DIM, DIM_SYM, FIELD, UNPACK
from ..render.loops import for_range
from . import registry

WORDS = 9  # per record


@registry.kind
@dataclass(frozen=True)
class ArgsEngine(registry.Engine):
    kind = "args"
    # a table walk, one call per region call: the lean pass list halves its compile
    # time (the first build's) and changes no call's cost
    pipeline = registry.Pipeline(speed_level=0, vectorize=False, lsr=False)

    def signature(self) -> ir.FunctionType:
        return ir.FunctionType(I32, [PTR, I32, PTR, PTR, PTR])

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        walk = _Walk(module, fn, b)
        with for_range(b, walk.word(walk.table, 0), "rec") as k:
            walk.open_record(k)
            done = fn.append_basic_block("rec.done")
            switch = b.switch(walk.op, done)
            for code, name, emit in walk.cases():
                switch.add_case(I64(code), block := fn.append_basic_block(name))
                b.position_at_end(block)
                emit(b.load(walk.slot, typ=PTR) if code not in (COUNT, UNPACK) else None)  # the DLTensor*
                b.branch(done)
            b.position_at_end(done)
        b.ret(I32(0))


class _Walk:
    """The engine's loop over the table: one record's fields, and one method per op that
    emits its case (``dl``: the argument's DLTensor*, where the op has one)."""

    def __init__(self, module: ir.Module, fn: ir.Function, b: ir.IRBuilder):
        self.b, (self.args, self.nargs, self.table, self.out, self.names) = b, fn.args
        self.msgbuf = b.alloca(ir.ArrayType(I8, 1024), name="msg")
        self.want = b.alloca(I64, name="want")
        self.snprintf = declare(module, "snprintf", I32, [PTR, I64, PTR], var_arg=True)
        self.raise_ = declare(module, "TVMFFIErrorSetRaisedFromCStr", ir.VoidType(), [PTR, PTR])
        self.value_error = _private_constant(module, ".str.ValueError",
                                             ir.Constant(ir.ArrayType(I8, 11), bytearray(b"ValueError\0")))

    def word(self, base, k):  # i64 element k
        return self.b.load(self.b.gep(base, [_i64(k)], source_etype=I64), typ=I64)

    def field(self, base, offset, ty):  # at byte offset
        return self.b.load(self.b.gep(base, [_i64(offset)], source_etype=I8), typ=ty)

    def open_record(self, k) -> None:
        b = self.b
        rec = b.gep(self.table, [b.add(I64(1), b.mul(k, I64(WORDS)))], source_etype=I64)
        self.op, self.arg, self.x, self.y, msg, self.show, *texts = (self.word(rec, j) for j in range(WORDS))
        self.message = b.gep(self.table, [msg], source_etype=I8)
        self.s0, self.s1, self.s2 = (lambda t=t: b.gep(self.names, [self.word(self.names, t)], source_etype=I8)
                                     for t in texts)
        self.slot = b.gep(self.out, [self.arg], source_etype=I64)  # the argument's DLTensor*, then its data

    def fail_if(self, pred, *values) -> None:  # strings are read only on failure (callables)
        b = self.b
        with b.if_then(pred, likely=False):
            values = [v() if callable(v) else v for v in values]
            b.call(self.snprintf, [self.msgbuf, I64(1024), self.message, *values])
            b.call(self.raise_, [self.value_error, self.msgbuf])
            b.ret(I32(-1))

    def cases(self):
        return ((COUNT, "count", self.count), (UNPACK, "unpack", self.unpack), (FIELD, "field", self.field_eq),
                (DIM, "dim", self.dim), (BIND, "bind", self.bind), (DIM_SYM, "dim.sym", self.dim_sym),
                (CONTIG, "contig", self.contig), (DATA, "data", self.data))

    def count(self, _dl) -> None:
        b = self.b
        self.fail_if(b.icmp_signed("!=", self.nargs, b.trunc(self.y, I32)), self.s0, self.nargs)

    def unpack(self, _dl) -> None:
        b = self.b
        any_ = b.gep(self.args, [b.mul(self.arg, I64(abi.ANY_SIZE))], source_etype=I8)
        tindex, value = b.load(any_, typ=I32), self.field(any_, 8, PTR)
        is_tensor = b.icmp_signed("==", tindex, I32(abi.TYPE_TENSOR))
        is_dl = b.icmp_signed("==", tindex, I32(abi.TYPE_DLTENSOR_PTR))
        self.fail_if(b.not_(b.or_(is_tensor, is_dl)), self.s0, tindex)
        shifted = b.gep(value, [I64(abi.TENSOR_DLTENSOR_OFFSET)], source_etype=I8)
        b.store(b.select(is_tensor, shifted, value), self.slot)

    def field_eq(self, dl) -> None:
        b = self.b
        got = self.field(dl, self.x, I32)
        parts = []
        for p in range(3):
            shift, width = (b.and_(b.lshr(self.show, I64(16 * p + s)), I64(0xFF)) for s in (0, 8))
            mask = b.sub(b.shl(I64(1), width), I64(1))
            parts.append(b.trunc(b.and_(b.lshr(b.zext(got, I64), shift), mask), I32))
        self.fail_if(b.icmp_signed("!=", got, b.trunc(self.y, I32)), self.s0, *parts)

    def shape(self, dl):
        return self.field(dl, abi.DL_SHAPE, PTR)

    def dim(self, dl) -> None:
        got = self.word(self.shape(dl), self.x)
        self.fail_if(self.b.icmp_signed("!=", got, self.y), self.s0, self.s1, got)

    def bind(self, dl) -> None:
        self.b.store(self.word(self.shape(dl), self.x), self.b.gep(self.out, [self.y], source_etype=I64))

    def dim_sym(self, dl) -> None:
        got, bound = self.word(self.shape(dl), self.x), self.word(self.out, self.y)
        self.fail_if(self.b.icmp_signed("!=", got, bound), self.s0, self.s1, got, self.s2, bound)

    def contig(self, dl) -> None:
        b, word, want = self.b, self.word, self.want
        shape, strides = self.shape(dl), self.field(dl, abi.DL_STRIDES, PTR)
        with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(strides, I64), I64(0))):
            with for_range(b, self.x, "axis") as axis:
                b.store(I64(1), want)
                with for_range(b, self.x, "later", start=b.add(axis, I64(1))) as later:
                    b.store(b.mul(b.load(want, typ=I64), word(shape, later)), want)
                got, expected = word(strides, axis), b.load(want, typ=I64)
                self.fail_if(b.and_(b.icmp_signed("!=", word(shape, axis), I64(1)),
                                    b.icmp_signed("!=", got, expected)),
                             self.s0, b.trunc(axis, I32), got, expected)

    def data(self, dl) -> None:
        b = self.b
        data = self.field(dl, abi.DL_DATA, PTR)
        b.store(b.gep(data, [self.field(dl, abi.DL_BYTE_OFFSET, I64)], source_etype=I8), self.slot)


def tables(module: ir.Module, kernel: kir.Kernel) -> tuple[ir.GlobalVariable, list, ir.GlobalVariable | None]:
    """``kernel``'s argument checks as tables for :class:`ArgsEngine` (see above): the
    checks before its derived sizes, the derived sizes (:class:`.abi.Derive`, which the
    entry computes itself), and the checks after them (None without derived sizes)."""
    checks = abi.plan(kernel)
    derive = [k for k, chk in enumerate(checks) if isinstance(chk, abi.Derive)]
    if not derive:
        return _table(module, kernel, checks, ""), [], None
    first, last = derive[0], derive[-1] + 1
    return (_table(module, kernel, checks[:first], ".bind", data=False), checks[first:last],
            _table(module, kernel, checks[last:], ".check"))


def _table(module: ir.Module, kernel: kir.Kernel, checks: list, suffix: str, data: bool = True):
    nparams = len(kernel.params)
    slot = {s: nparams + k for k, s in enumerate(kernel.sym_vars)}
    records = [chk.record(slot) + tuple(chk.strings) + (0,) * (3 - len(chk.strings)) for chk in checks]
    records += [(DATA, i, 0, 0, "", 0, 0, 0, 0) for i in range(nparams)] if data else []

    text, offsets = bytearray(), {}
    start = 8 * (1 + WORDS * len(records))
    for message in dict.fromkeys(r[4] for r in records):
        offsets[message] = start + len(text)
        text += message.encode() + b"\0"
    words = [len(records)] + [v for r in records for v in (*r[:4], offsets[r[4]], *r[5:])]
    init = ir.Constant.literal_struct([ir.Constant(ir.ArrayType(I64, len(words)), words),
                                       ir.Constant(ir.ArrayType(I8, len(text)), text)])
    g = _private_constant(module, f"{kernel.name}.args{suffix}", init)
    g.align = 8
    return g


def _i64(v) -> ir.Value:
    return v if isinstance(v, ir.Value) else I64(v)


def _private_constant(module: ir.Module, name: str, init: ir.Constant) -> ir.GlobalVariable:
    g = ir.GlobalVariable(module, init.type, name)
    g.global_constant, g.linkage, g.unnamed_addr, g.initializer = True, "private", True, init
    return g

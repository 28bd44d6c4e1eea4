"""The argument checks of every region's entry as data, run by one shared library engine.

Rendered inline, the checks of :func:`jitbyoc.lowering.abi.plan` cost a compare, a
``snprintf`` and a raise per check: 250-450 instructions and 15-30 ms of LLVM time in
every region. Instead a region encodes its plan as a table (:func:`table`) and calls
``i32 jitbyoc_lib_args(ptr args, i32 nargs, ptr table, ptr out, ptr names)``, compiled once
per machine (:mod:`jitbyoc.library`). It returns 0, or -1 with a ``ValueError`` set.

The table is one private constant ``{ [n x i64], [m x i8] }``: the number of records,
then the records, then the messages (NUL-terminated printf formats, jitbyoc's text
only). A record is nine i64 words ``op, arg, x, y, msg, show, s0, s1, s2``; ``msg`` is
the byte offset of its message from the start of the table, so the table needs no
relocations; ``s0..s2`` index strings of ``names``, the names table of this use of the
region (:func:`jitbyoc.lowering.abi.names_table`: i64 offsets, then the strings), which
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
at run time too) has no stride to check, as in :mod:`jitbyoc.lowering.c_entry`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from llvmlite import ir

from .. import kir, library
from . import abi
from ..llvmtypes import I8, I32, I64, PTR, declare
from .loops import for_range

COUNT, UNPACK, FIELD, DIM, BIND, DIM_SYM, CONTIG, DATA = range(8)
WORDS = 9  # per record


@library.kind
@dataclass(frozen=True)
class ArgsEngine(library.Engine):
    kind = "args"
    # a table walk, one call per region call: the lean pass list halves its compile
    # time (the first build's) and changes no call's cost
    pipeline = library.Pipeline(speed_level=0, vectorize=False, lsr=False)

    def signature(self) -> ir.FunctionType:
        return ir.FunctionType(I32, [PTR, I32, PTR, PTR, PTR])

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        args, nargs, table, out, names = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        msgbuf = b.alloca(ir.ArrayType(I8, 1024), name="msg")
        want = b.alloca(I64, name="want")
        snprintf = declare(module, "snprintf", I32, [PTR, I64, PTR], var_arg=True)
        raise_ = declare(module, "TVMFFIErrorSetRaisedFromCStr", ir.VoidType(), [PTR, PTR])
        value_error = _private_constant(module, ".str.ValueError",
                                        ir.Constant(ir.ArrayType(I8, 11), bytearray(b"ValueError\0")))

        def word(base, k):  # i64 element k
            return b.load(b.gep(base, [_i64(k)], source_etype=I64), typ=I64)

        def field(base, offset, ty):  # at byte offset
            return b.load(b.gep(base, [_i64(offset)], source_etype=I8), typ=ty)

        with for_range(b, word(table, 0), "rec") as k:
            rec = b.gep(table, [b.add(I64(1), b.mul(k, I64(WORDS)))], source_etype=I64)
            op, arg, x, y, msg, show, *texts = (word(rec, j) for j in range(WORDS))
            message = b.gep(table, [msg], source_etype=I8)
            s0, s1, s2 = (lambda t=t: b.gep(names, [word(names, t)], source_etype=I8) for t in texts)
            slot = b.gep(out, [arg], source_etype=I64)  # the argument's DLTensor*, then its data

            def fail_if(pred, *values):  # strings are read only on failure (callables)
                with b.if_then(pred, likely=False):
                    values = [v() if callable(v) else v for v in values]
                    b.call(snprintf, [msgbuf, I64(1024), message, *values])
                    b.call(raise_, [value_error, msgbuf])
                    b.ret(I32(-1))

            done = fn.append_basic_block("rec.done")
            switch = b.switch(op, done)

            @contextmanager
            def case(code: int, name: str):
                switch.add_case(I64(code), block := fn.append_basic_block(name))
                b.position_at_end(block)
                yield b.load(slot, typ=PTR) if code not in (COUNT, UNPACK) else None  # the DLTensor*
                b.branch(done)

            with case(COUNT, "count"):
                fail_if(b.icmp_signed("!=", nargs, b.trunc(y, I32)), s0, nargs)

            with case(UNPACK, "unpack"):
                any_ = b.gep(args, [b.mul(arg, I64(abi.ANY_SIZE))], source_etype=I8)
                tindex, value = b.load(any_, typ=I32), field(any_, 8, PTR)
                is_tensor = b.icmp_signed("==", tindex, I32(abi.TYPE_TENSOR))
                is_dl = b.icmp_signed("==", tindex, I32(abi.TYPE_DLTENSOR_PTR))
                fail_if(b.not_(b.or_(is_tensor, is_dl)), s0, tindex)
                shifted = b.gep(value, [I64(abi.TENSOR_DLTENSOR_OFFSET)], source_etype=I8)
                b.store(b.select(is_tensor, shifted, value), slot)

            with case(FIELD, "field") as dl:
                got = field(dl, x, I32)
                parts = []
                for p in range(3):
                    shift, width = (b.and_(b.lshr(show, I64(16 * p + s)), I64(0xFF)) for s in (0, 8))
                    mask = b.sub(b.shl(I64(1), width), I64(1))
                    parts.append(b.trunc(b.and_(b.lshr(b.zext(got, I64), shift), mask), I32))
                fail_if(b.icmp_signed("!=", got, b.trunc(y, I32)), s0, *parts)

            with case(DIM, "dim") as dl:
                got = word(field(dl, abi.DL_SHAPE, PTR), x)
                fail_if(b.icmp_signed("!=", got, y), s0, s1, got)

            with case(BIND, "bind") as dl:
                b.store(word(field(dl, abi.DL_SHAPE, PTR), x), b.gep(out, [y], source_etype=I64))

            with case(DIM_SYM, "dim.sym") as dl:
                got, bound = word(field(dl, abi.DL_SHAPE, PTR), x), word(out, y)
                fail_if(b.icmp_signed("!=", got, bound), s0, s1, got, s2, bound)

            with case(CONTIG, "contig") as dl:
                shape, strides = field(dl, abi.DL_SHAPE, PTR), field(dl, abi.DL_STRIDES, PTR)
                with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(strides, I64), I64(0))):
                    with for_range(b, x, "axis") as axis:
                        b.store(I64(1), want)
                        with for_range(b, x, "later", start=b.add(axis, I64(1))) as later:
                            b.store(b.mul(b.load(want, typ=I64), word(shape, later)), want)
                        got, expected = word(strides, axis), b.load(want, typ=I64)
                        fail_if(b.and_(b.icmp_signed("!=", word(shape, axis), I64(1)),
                                       b.icmp_signed("!=", got, expected)),
                                s0, b.trunc(axis, I32), got, expected)

            with case(DATA, "data") as dl:
                data = field(dl, abi.DL_DATA, PTR)
                b.store(b.gep(data, [field(dl, abi.DL_BYTE_OFFSET, I64)], source_etype=I8), slot)

            b.position_at_end(done)
        b.ret(I32(0))


def table(module: ir.Module, kernel: kir.Kernel) -> ir.GlobalVariable:
    """``kernel``'s argument checks as a table for :class:`ArgsEngine` (see above)."""
    nparams = len(kernel.params)
    slot = {s: nparams + k for k, s in enumerate(kernel.sym_vars)}
    records = []
    plan = abi.plan(kernel)
    for chk in plan:
        if isinstance(chk, abi.ArgCount):
            records.append((COUNT, 0, 0, chk.expected, chk.message, 0))
        elif isinstance(chk, abi.Unpack):
            records.append((UNPACK, chk.index, 0, 0, chk.message, 0))
        elif isinstance(chk, abi.FieldEq):
            assert chk.bits == 32 and len(chk.parts) <= 3
            show = 0
            for p, (shift, mask) in enumerate(chk.parts):
                width = 32 if mask < 0 else mask.bit_length()
                assert mask < 0 or mask == (1 << width) - 1
                show |= (shift | width << 8) << 16 * p
            records.append((FIELD, chk.index, chk.offset, chk.expected, chk.message, show))
        elif isinstance(chk, abi.DimEq):
            op = BIND if chk.binds else DIM_SYM if isinstance(chk.expected, str) else DIM
            expected = slot[chk.expected] if isinstance(chk.expected, str) else chk.expected
            records.append((op, chk.index, chk.axis, expected, chk.message, 0))
        elif isinstance(chk, abi.Contiguous):
            records.append((CONTIG, chk.index, kernel.params[chk.index].ndim, 0, chk.message, 0))
    records = [r + tuple(chk.strings) + (0,) * (3 - len(chk.strings)) for r, chk in zip(records, plan)]
    records += [(DATA, i, 0, 0, "", 0, 0, 0, 0) for i in range(nparams)]

    text, offsets = bytearray(), {}
    start = 8 * (1 + WORDS * len(records))
    for message in dict.fromkeys(r[4] for r in records):
        offsets[message] = start + len(text)
        text += message.encode() + b"\0"
    words = [len(records)] + [v for r in records for v in (*r[:4], offsets[r[4]], *r[5:])]
    init = ir.Constant.literal_struct([ir.Constant(ir.ArrayType(I64, len(words)), words),
                                       ir.Constant(ir.ArrayType(I8, len(text)), text)])
    g = _private_constant(module, f"{kernel.name}.args", init)
    g.align = 8
    return g


def _i64(v) -> ir.Value:
    return v if isinstance(v, ir.Value) else I64(v)


def _private_constant(module: ir.Module, name: str, init: ir.Constant) -> ir.GlobalVariable:
    g = ir.GlobalVariable(module, init.type, name)
    g.global_constant, g.linkage, g.unnamed_addr, g.initializer = True, "private", True, init
    return g

"""Explicit vectors for llvmlite builders: splats, lane masks, masked loads and stores.

Kernels and fused loops that write ``<n x T>`` vectors themselves do not depend on
LLVM's loop vectorizer (and their modules skip it: see :data:`jitbyoc.toolchain.jit.GLUE`).
A vector is :data:`jitbyoc.render.isa.VECTOR_BYTES` (one AVX-512 register); on narrower
hosts LLVM splits each one.
"""

from __future__ import annotations

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I1, I8, I32, I64, PTR, declare
from . import isa
from .loops import for_range


def lanes(dt: str) -> int:
    """Elements of ``dt`` in one vector as kernels write them."""
    return isa.lanes(dt, isa.VECTOR_BITS)


def vtype(dt: str, n: int | None = None) -> ir.VectorType:
    return ir.VectorType(lookup_dtype(dt).storage_ir, n or lanes(dt))


intrinsic = declare  # an llvm.* intrinsic is declared like any function


def prefetch(b: ir.IRBuilder, ptr, write: bool = False, nbytes: int = 1, locality: int = 3) -> None:
    """Ask for the cache lines of ``nbytes`` from ``ptr`` for reading or ``write``, into
    the levels ``locality`` names (3: every level; 2: L2 and out, ``prefetcht1``); a
    prefetch never faults, so an address past a buffer's end is harmless."""
    fn = intrinsic(b.module, "llvm.prefetch.p0", ir.VoidType(), [PTR, I32, I32, I32])
    for line in range(0, nbytes, 64):
        at = b.gep(ptr, [I64(line)], source_etype=I8) if line else ptr
        b.call(fn, [at, I32(int(write)), I32(locality), I32(1)])


def suffix(vt: ir.VectorType) -> str:
    t = vt.element
    kind = f"i{t.width}" if isinstance(t, ir.IntType) else "f32" if isinstance(t, ir.FloatType) else "f64"
    return f"v{vt.count}{kind}"


class SplatConstant(ir.Constant):
    """A vector constant with every lane equal, printed as LLVM's ``splat (T v)`` (a
    sixteenth of the text of the lane-by-lane form: less IR to print and parse)."""

    def __init__(self, value: ir.Constant, n: int):
        super().__init__(ir.VectorType(value.type, n), value.constant)

    def _get_reference(self):
        first = self.constant[0]
        return f"splat ({first.type} {first.get_reference()})"


class VectorLiteral(ir.Constant):
    """A whole-vector literal (``zeroinitializer``, ``poison``), printed as one word."""

    def __init__(self, vt: ir.VectorType, word: str):
        super().__init__(vt, None)
        self.word = word

    def _get_reference(self):
        return self.word


def splat(b: ir.IRBuilder, value, n: int):
    """``n`` lanes of ``value``; the vector keeps ``value`` as ``splat_of`` (a lookup
    whose row is a splat reads one row: :meth:`jitbyoc.render.llvm.Ctx.row_lookup`)."""
    vt = ir.VectorType(value.type, n)
    v = b.insert_element(VectorLiteral(vt, "poison"), value, I32(0))
    v = b.shuffle_vector(v, VectorLiteral(vt, "poison"), VectorLiteral(ir.VectorType(I32, n), "zeroinitializer"))
    v.splat_of = value
    return v


def lane_mask(b: ir.IRBuilder, limit, n: int):
    """``<n x i1>``: lane ``l`` is set when ``l < limit`` (an i64 value or int)."""
    if isinstance(limit, int):
        return ir.Constant(ir.VectorType(I1, n), [int(l < limit) for l in range(n)])
    lim = b.trunc(b.select(b.icmp_signed("<", limit, I64(n)), limit, I64(n)), I32)
    return b.icmp_signed("<", ir.Constant(ir.VectorType(I32, n), list(range(n))), splat(b, lim, n))


def vload(b, ptr, dt, mask=None, n: int | None = None):
    """``n`` (default: one register) elements of ``dt`` at ``ptr``, as stored; with
    ``mask``, unset lanes read 0 and touch no memory."""
    vt = vtype(dt, n)
    align = lookup_dtype(dt).nbytes
    if mask is None:
        return b.load(ptr, typ=vt, align=align)
    fn = intrinsic(b.module, f"llvm.masked.load.{suffix(vt)}.p0", vt,
                    [PTR, I32, ir.VectorType(I1, vt.count), vt])
    return b.call(fn, [ptr, I32(align), mask, VectorLiteral(vt, "zeroinitializer")])


def vstore(b, value, ptr, dt, mask=None):
    """Store the vector ``value`` (elements of ``dt``, as stored) at ``ptr``."""
    align = lookup_dtype(dt).nbytes
    if mask is None:
        b.store(value, ptr, align=align)
        return
    vt = value.type
    fn = intrinsic(b.module, f"llvm.masked.store.{suffix(vt)}.p0", ir.VoidType(),
                    [vt, PTR, I32, ir.VectorType(I1, vt.count)])
    b.call(fn, [value, ptr, I32(align), mask])


def vlookup(b: ir.IRBuilder, table, index, dt: str, size: int):
    """``table[index[l]]`` for every lane ``l`` of the integer vector ``index`` (in range),
    ``table`` pointing at ``size`` elements of ``dt``: a byte table of 256 on AVX512_VBMI
    is four registers, and a vector of lookups two ``vpermi2b`` and a blend; a table of
    up to 16 32-bit words is one register (:func:`permuted_words`); anything else is one
    load per lane."""
    n, element = index.type.count, lookup_dtype(dt).storage_ir
    if lookup_dtype(dt).storage_bits == 8 and size == 256 and n <= 64 and isa.current().has("avx512vbmi"):
        return _permuted_bytes(b, table, index)
    if lookup_dtype(dt).storage_bits == 32 and size <= WORD_TABLE and permutes_words(n):
        words = b.load(table, typ=ir.VectorType(element, size), align=4)
        if size < WORD_TABLE:
            words = b.shuffle_vector(words, VectorLiteral(words.type, "poison"),
                                     ir.Constant(ir.VectorType(I32, WORD_TABLE), [min(l, size - 1) for l in range(WORD_TABLE)]))
        return permuted_words(b, words, index)
    out = VectorLiteral(ir.VectorType(element, n), "poison")
    for lane in range(n):
        at = b.extract_element(index, I32(lane))
        at = at if at.type == I64 else b.sext(at, I64)
        value = b.load(b.gep(table, [at], source_etype=element, inbounds=True), typ=element)
        out = b.insert_element(out, value, I32(lane))
    return out


WORD_TABLE = 16  # entries of a table of 32-bit words kept in one AVX-512 register


def permutes_words(n: int) -> bool:
    """Whether :func:`permuted_words` picks ``n`` lanes with register permutes here."""
    return n in (8, 16, 32, 64) and (isa.current().has("avx512f") or isa.current().has("avx2"))


def permuted_words(b: ir.IRBuilder, words, index):
    """``words[index[l]]`` for each lane ``l`` of the integer vector ``index`` (in range),
    ``words`` a vector of :data:`WORD_TABLE` 32-bit elements: one ``vpermps`` per 16
    lanes with AVX-512; with AVX2, per 8 lanes a ``vpermps`` of each half of the table
    and a blend on the index's bit 3."""
    element, n = words.type.element, index.type.count
    f32 = ir.FloatType()
    table = words if element == f32 else b.bitcast(words, ir.VectorType(f32, WORD_TABLE))
    index = b.trunc(index, ir.VectorType(I32, n)) if index.type.element.width > 32 else \
        b.sext(index, ir.VectorType(I32, n)) if index.type.element.width < 32 else index
    if isa.current().has("avx512f"):
        step, fn = 16, intrinsic(b.module, "llvm.x86.avx512.permvar.sf.512", ir.VectorType(f32, 16),
                                 [ir.VectorType(f32, 16), ir.VectorType(I32, 16)])
        parts = [b.call(fn, [table, _lanes(b, index, lo, 16)]) for lo in range(0, n, 16)]
    else:
        step, v8 = 8, ir.VectorType(f32, 8)
        fn = intrinsic(b.module, "llvm.x86.avx2.permps", v8, [v8, ir.VectorType(I32, 8)])
        blend = intrinsic(b.module, "llvm.x86.avx.blendv.ps.256", v8, [v8] * 3)
        halves = [_lanes(b, table, lo, 8) for lo in (0, 8)]
        parts = []
        for lo in range(0, n, 8):  # the blend reads the sign bit: the index's bit 3, shifted up
            at = _lanes(b, index, lo, 8)
            upper = b.bitcast(b.shl(at, SplatConstant(I32(28), 8)), v8)
            parts.append(b.call(blend, [b.call(fn, [halves[0], at]), b.call(fn, [halves[1], at]), upper]))
    out = concatenated(b, parts)
    out = _lanes(b, out, 0, n) if n < step else out
    return out if element == f32 else b.bitcast(out, ir.VectorType(element, n))


def _lanes(b: ir.IRBuilder, v, lo: int, n: int):
    """Lanes ``lo .. lo + n`` of ``v`` (past its end: poison)."""
    count = v.type.count
    return b.shuffle_vector(v, VectorLiteral(v.type, "poison"),
                            ir.Constant(ir.VectorType(I32, n), [l if l < count else count for l in range(lo, lo + n)]))


def concatenated(b: ir.IRBuilder, parts: list):
    """The vectors ``parts`` (a power of two of them, of equal length) side by side:
    pairs joined, then the pairs' results, one two-source shuffle each."""
    while len(parts) > 1:
        width = parts[0].type.count
        parts = [b.shuffle_vector(parts[i], parts[i + 1], ir.Constant(ir.VectorType(I32, 2 * width), list(range(2 * width))))
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _permuted_bytes(b: ir.IRBuilder, table, index):
    """:func:`vlookup` of a 256-byte table with ``vpermi2b``: each picks by the low 7 bits
    of an index from 128 table bytes; bit 7 chooses between the two halves."""
    n, bytes64 = index.type.count, ir.VectorType(I8, 64)
    quarters = [b.load(b.gep(table, [I64(64 * k)], source_etype=I8), typ=bytes64, align=1) for k in range(4)]
    narrow = b.trunc(index, ir.VectorType(I8, n))
    wide = narrow if n == 64 else b.shuffle_vector(
        narrow, VectorLiteral(narrow.type, "poison"), ir.Constant(ir.VectorType(I32, 64), [l % n for l in range(64)]))
    permute = intrinsic(b.module, "llvm.x86.avx512.vpermi2var.qi.512", bytes64, [bytes64] * 3)
    low, high = (b.call(permute, [quarters[k], wide, quarters[k + 1]]) for k in (0, 2))
    picked = b.select(b.icmp_signed("<", wide, VectorLiteral(bytes64, "zeroinitializer")), high, low)
    return picked if n == 64 else b.shuffle_vector(
        picked, VectorLiteral(bytes64, "poison"), ir.Constant(ir.VectorType(I32, n), list(range(n))))


def multiply_add(b: ir.IRBuilder, x, y, acc):
    """``x * y + acc``: one fused multiply-add (one rounding) where the machine has them,
    else a multiply and an add."""
    if not isa.has_fma():
        return b.fadd(b.fmul(x, y), acc)
    fn = intrinsic(b.module, f"llvm.fma.{suffix(x.type)}", x.type, [x.type] * 3)
    return b.call(fn, [x, y, acc])


def strips(b: ir.IRBuilder, start, stop, n: int, body) -> None:
    """``body(i, mask)`` for ``i = start, start + n, ...`` below ``stop`` (i64 values):
    whole vectors with ``mask`` None (masked loads and stores cost 3 % on long loops),
    then the remainder, if any, once with a lane mask (a constant for constant bounds)."""
    if isinstance(start, ir.Constant) and isinstance(stop, ir.Constant):
        whole, rest = divmod(stop.constant - start.constant, n)
        with for_range(b, I64(whole), "v") as v:
            body(b.add(start, b.mul(v, I64(n), flags=["nsw"]), flags=["nsw"]), None)
        if rest > 0:
            body(I64(start.constant + whole * n), lane_mask(b, rest, n))
        return
    with for_range(b, b.sdiv(b.sub(stop, start), I64(n)), "v") as v:
        body(b.add(start, b.mul(v, I64(n), flags=["nsw"]), flags=["nsw"]), None)
    tail = b.add(start, b.mul(b.sdiv(b.sub(stop, start), I64(n)), I64(n), flags=["nsw"]), flags=["nsw"])
    with b.if_then(b.icmp_signed("<", tail, stop)):
        body(tail, lane_mask(b, b.sub(stop, tail), n))

"""The direct-convolution engine's packing for products in units of several input
channels (:mod:`.products`: a bfloat16 pair is one 32-bit unit). Workspace channel
``ch`` of group ``grp`` interleaves input channels ``grp*cg + group*u + e`` (``u = ch -
grp*units``) at each pixel, so that one vector load of units is ``lanes`` pixels of
``group`` channels, the operand ``vdpbf16ps`` (pairs) or ``vpdpbusd`` (quads) takes; a
group whose channel count is not a multiple of ``group`` gets zero channels. The weight
is packed alike (:func:`jitbyoc.tvm.conv_weights.pack`), and the engine's loops run over
unit channels (:meth:`.conv_engine.Emit.channels`).
"""

from __future__ import annotations

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I64
from ..render.loops import for_range
from ..render.vectors import lanes, strips, vload, vstore
from .gemm_units import interleave


def sources(emit, c, n, ch) -> list:
    """``[(input offset of the channel's plane, valid)]`` for each channel unit ``ch``
    interleaves; a channel past its group's last reads the unit's first channel instead
    (a valid address) and ``valid`` (an i1) says to zero it."""
    b, s, group = c.b, c.syms, emit.product.group
    units = emit.channels(c)
    grp, u = b.sdiv(ch, units), b.srem(ch, units)
    first = b.add(b.mul(grp, s["cg"]), b.mul(u, I64(group)))
    out = []
    for e in range(group):
        valid = b.icmp_signed("<", b.add(b.mul(u, I64(group)), I64(e)), s["cg"])
        channel = b.select(valid, b.add(first, I64(e)), first)
        out.append((b.mul(b.add(b.mul(n, s["c"]), channel), b.mul(s["h"], s["wd"])), valid))
    return out


def row_copy(emit, c, dst, firsts: list, count, stride) -> None:
    """:meth:`.conv_engine.Emit.row_copy` in units: ``count`` pixels, ``stride`` apart
    from each source of ``firsts`` (``(offset, valid)``), interleaved into the workspace
    at ``dst``: vectors for strides 1 and 2, pixels otherwise."""
    b, product = c.b, emit.product
    dt, unit = product.a, product.unit
    n, x, work = lanes(unit), emit.bufs["x"], emit.bufs["work"]
    element = lookup_dtype(dt).ir  # bfloat16 as its 16 bits
    zero = ir.Constant(ir.VectorType(element, n), None)

    def vectors(load):  # load(at, j, mask): one source's n elements from pixel j
        def store(j, mask):
            parts = [b.select(valid, load(at, j, mask), zero) for at, valid in firsts]
            units = b.bitcast(interleave(b, parts), ir.VectorType(ir.IntType(32), n))
            vstore(b, units, c.element(work, b.add(dst, j)), unit, mask)
        strips(b, I64(0), count, n, store)

    with b.if_else(b.icmp_signed("==", stride, I64(1))) as (contiguous, strided):
        with contiguous:
            vectors(lambda at, j, mask: vload(b, c.element(x, b.add(at, j)), dt, mask, n))
        with strided, b.if_else(b.icmp_signed("==", stride, I64(2))) as (pairs, other):
            with pairs:
                vectors(lambda at, j, mask: emit.even_lanes(
                    c, b.add(at, b.mul(j, I64(2))), n if mask is None else b.sub(count, j)))
            with other, for_range(b, count, "q") as q:
                bits = [b.zext(b.select(valid, c.load(x, b.add(at, b.mul(q, stride))), element(0)),
                               ir.IntType(32)) for at, valid in firsts]
                value = bits[0]
                for e, more in enumerate(bits[1:], 1):  # channel e in bits e*width.. of the unit
                    value = b.or_(value, b.shl(more, ir.IntType(32)(e * element.width)))
                c.store(work, b.add(dst, q), value)


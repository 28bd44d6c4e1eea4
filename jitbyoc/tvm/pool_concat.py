"""A pool of a channel concatenation pools each part: ``pool(concat([a, b, ...], axis=1))``
becomes ``concat([pool(a), pool(b), ...], axis=1)``.

A 2-D pool reads each channel alone, so the two are equal element for element (a max
is exact, an average sums the same window of the same channel). An Inception module
ends so: its four branches concatenated, then a max pool of stride 2 that halves both
sides, where the concatenation wrote the whole map (1.4 MB in float32 at 480 x 27 x 27)
for the pool to read once. Pooled first, each branch's pool reads the branch's output
where its convolution left it, and the concatenation copies a quarter of the bytes.
Only where the concatenation has no other user: otherwise it stays, and the pools would
be extra work.
"""

from __future__ import annotations

from tvm import relax
from tvm.ir import Op

from .inference import bound_value

POOLS = frozenset(Op.get(f"relax.nn.{kind}_pool2d") for kind in ("max", "avg"))
CONCAT = Op.get("relax.concat")
DEQUANTIZE = Op.get("relax.dequantize")
TRIGGERS = frozenset({"relax.concat"})


def pooled_parts(call: relax.Call, lookup, uses: dict, emit) -> relax.Expr | None:
    """``call`` (a pool: :data:`POOLS`) as the concatenation of its input's parts pooled,
    or None.

    ``lookup``: a var's bound value; ``uses``: a var's name -> its uses; ``emit``: binds
    an expression, returning its var."""
    parts = _parts(call, lookup, uses)
    if parts is None:
        return None
    return relax.op.concat([emit(relax.Call(call.op, [p], call.attrs)) for p in parts.fields], axis=1)


def splits(call: relax.Call, lookup, uses: dict) -> bool:
    """Whether :func:`pooled_parts` rewrites ``call``: a bfloat16 pool is left narrow for
    it (:mod:`.widen`), then each part's pool widened, where widening the whole
    concatenation first hid it (the concatenation, then its float32 copy, for one pool)."""
    return any(call.op.same_as(p) for p in POOLS) and _parts(call, lookup, uses) is not None


def _parts(call: relax.Call, lookup, uses: dict) -> relax.Tuple | None:
    """The parts of the channel concatenation that ``call`` alone pools, or None."""
    x = call.args[0]
    if str(call.attrs.layout) != "NCHW" or str(call.attrs.out_layout or call.attrs.layout) != "NCHW" \
            or not isinstance(x, relax.Var) or uses.get(x.name, 0) != 1:
        return None
    concat = lookup(x)
    if not (isinstance(concat, relax.Call) and concat.op.same_as(CONCAT)):
        return None
    parts, axis = bound_value(concat.args[0], lookup), concat.attrs.axis
    if not isinstance(parts, relax.Tuple) or axis is None or int(axis) % 4 != 1:
        return None
    if any(str(p.ty.dtype) != str(x.ty.dtype) or _dequantized(bound_value(p, lookup)) for p in parts.fields):
        return None  # a QDQ graph's: its requantization moves the integers (quantized.requantized)
    return parts


def _dequantized(value) -> bool:
    return isinstance(value, relax.Call) and value.op.same_as(DEQUANTIZE)

"""The element types the heavy engines multiply in: one row per kind of product.

A product multiplies elements of A by elements of B, sums the products in the
accumulator's type and stores elements of ``out``. Every engine that multiplies (the
GEMM engine and its GEMV forms, the direct and channel convolutions, depthwise, fused
attention) and every build-time packer (:mod:`jitbyoc.tvm.linear`'s panels,
:mod:`jitbyoc.tvm.conv_weights`' channel blocks) asks this table what it computes, so
what the engines take is written once.

The float rows multiply one dtype by itself with fused multiply-adds (``group`` 1: one
k per instruction). A narrower product is a row whose types differ, and whose ``group``
is the k's one dot-product instruction sums (bfloat16 pairs on ``vdpbf16ps``: 2; int8
quads on ``vpdpbusd``: 4). The GEMM engine then works in *units* of ``group``
consecutive k (:attr:`Product.unit`: a bfloat16 pair is one 32-bit unit): packers write
B's units column after column (k interleaved), A's are read or packed as they lie along
k, and K is padded with zeros to whole units.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.dtypes import dtype as lookup_dtype


@dataclass(frozen=True)
class Product:
    a: str  # A's elements (activations; rows of the GEMM)
    b: str  # B's elements (weights; columns)
    acc: str  # what the products are summed in
    out: str  # what is stored
    group: int = 1  # consecutive k one instruction takes

    @property
    def uniform(self) -> bool:
        """One dtype throughout (the engines' float rows)."""
        return self.a == self.b == self.acc == self.out

    @property
    def unit(self) -> str:
        """The dtype the engine moves A's and B's elements in: one element, or ``group``
        of them as one integer (a bfloat16 pair, an int8 quad: int32)."""
        return self.a if self.group == 1 else f"int{lookup_dtype(self.a).bits * self.group}"


PRODUCTS = {dt: Product(dt, dt, dt, dt) for dt in ("float32", "float64")}
# bfloat16 operands summed in float32 (vdpbf16ps where the machine has AVX512_BF16): the
# products of jitbyoc.lower_precision's bf16 mode
PRODUCTS["bfloat16"] = Product("bfloat16", "bfloat16", "float32", "float32", group=2)
# uint8 activations times int8 weights summed in int32 (vpdpbusd where the machine has
# AVX512_VNNI): the products of quantized graphs (jitbyoc.tvm.quantized)
PRODUCTS["uint8"] = Product("uint8", "int8", "int32", "int32", group=4)
# and the other way round: a convolution run as a matrix product (weight @ pixels)
PRODUCTS["int8"] = Product("int8", "uint8", "int32", "int32", group=4)
# the dtypes multiplied by themselves into themselves: what an op of one dtype runs on
UNIFORM = tuple(dt for dt, product in PRODUCTS.items() if product.uniform)
OPERANDS = frozenset(dt for product in PRODUCTS.values() for dt in (product.a, product.b))  # what products read
RESULTS = frozenset(product.out for product in PRODUCTS.values())  # what they store


# the product that reads a weight (B) of each dtype: B's dtype names its row (each row
# reads its own), which is what build-time packers of constant weights go by
WEIGHTS = {product.b: product for product in PRODUCTS.values()}
assert len(WEIGHTS) == len(PRODUCTS), "two products read the same weight dtype"


def product_of(a: str, b: str, out: str) -> Product | None:
    """The row that multiplies ``a`` by ``b`` into ``out``, or None."""
    found = PRODUCTS.get(a)
    return found if found is not None and (found.b, found.out) == (b, out) else None

"""The element types the heavy engines multiply in: one row per kind of product.

A product multiplies elements of A by elements of B, sums the products in the
accumulator's type and stores elements of ``out``. Every engine that multiplies (the
GEMM engine and its GEMV forms, the direct and channel convolutions, depthwise, fused
attention) and every build-time packer (:mod:`jitbyoc.tvm.linear`'s panels,
:mod:`jitbyoc.tvm.conv_weights`' channel blocks) asks this table what it computes, so
what the engines take is written once.

Today every row multiplies one float dtype by itself with fused multiply-adds (``group``
1: one k per instruction). A narrower product is a row whose types differ, and whose
``group`` is the k's one dot-product instruction sums (bf16 pairs on ``vdpbf16ps``: 2;
int8 quads on ``vpdpbusd``: 4), which the packers interleave.
"""

from __future__ import annotations

from dataclasses import dataclass


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


PRODUCTS = {dt: Product(dt, dt, dt, dt) for dt in ("float32", "float64")}
# the dtypes multiplied by themselves into themselves: what an op of one dtype runs on
UNIFORM = tuple(dt for dt, product in PRODUCTS.items() if product.uniform)

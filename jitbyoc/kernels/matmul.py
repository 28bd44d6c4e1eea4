"""``relax.matmul`` on the packed GEMM engine (:mod:`jitbyoc.engines.gemm`), with fused epilogues.

Every form the frontends produce: 2-D, batched (any rank), NumPy-broadcast batch dims
(``(B, M, K) x (K, N)``, ``(1, M, K) x (B, K, N)``), 1-D operands (``(K,) x (K, N)`` is a
``1 x N`` product whose unit row is dropped, and so on), symbolic sizes read at run time,
float32 and float64, and bfloat16 operands summed in float32 (the products
:func:`jitbyoc.lower_precision` makes: ``vdpbf16ps``, :mod:`jitbyoc.engines.products`). A transposed operand is read in place: ``MatMul.perms[i]`` says
operand ``i`` is ``permute_dims(inputs[i], perms[i])``, and :func:`fold_permutes` (a
kernel pass) points the matmul at the permute's source instead of its temporary, so
``linear`` (``permute_dims(w)`` then ``matmul``) packs ``w`` directly with in-register
transposes. Bias add and activation fold into the epilogue (``matmul+add+relu``...).

Accuracy. Each output is a sum of K products. TVM's default build sums ``k`` in order
with a multiply and an add (two roundings per step); the LLVM rendering sums ``k`` in
order within blocks of at most ``gemm.KC`` with fused multiply-adds, then adds the block
sums; the C rendering (``-ffp-contract=off``) matches TVM's order. Either order's error
is at most ``gamma_K * (|A| @ |B|)`` with ``gamma_K = K*u/(1-K*u)`` (Higham, *Accuracy
and Stability*, 3.1), so two renderings differ by at most ``2 * gamma_K * (|A| @ |B|)``
elementwise. The tests check exactly that bound (``u = eps/2`` of the dtype) plus the
epilogue's own error (one rounding for the bias add, the op table's ulp bound for the
activation, propagated through its Lipschitz constant). In practice errors are near
``sqrt(K) * u`` relative, far inside the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..engines import gemm_engine, gemm_llvm
from ..engines.gemm import Gemm, Output, Panels, Strided, box_epilogue, rows_epilogue
from ..engines.products import OPERANDS, PRODUCTS, RESULTS, Product, product_of
from ..ir import kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.relax_types import broadcast_problem, dims, operands_problem
from ..ir.rules import register



def _strides(shape) -> list[tuple]:
    """Row-major strides of ``shape``, each a tuple of dims (their product)."""
    return [tuple(shape[j + 1:]) for j in range(len(shape))]


@dataclass(eq=False)
class MatMul(kir.KernelStage):
    perms: tuple = (None, None)  # operand i is permute_dims(inputs[i], perms[i]); None: as is
    panels: int = 0  # B is inputs[1] packed in panels of this many columns (..., N/w, K, w); 0: not
    stream_a: bool = False  # A is a weight from memory (Gemm.stream_a)
    writes_epilogue_apart = True  # the GEMM engine's epilogue callbacks take finished blocks

    def operand(self, i: int):
        """(logical shape, stride of each logical dim) of operand ``i`` (for B in panels,
        its logical (..., K, N) shape, and strides for the leading dims only)."""
        buf, perm = self.inputs[i], self.perms[i]
        if i == 1 and self.panels:  # (..., N/w, K, w), or (..., N/w, K/g, w, g) in units of g k
            group = self.product.group
            *lead, count, k, width = buf.shape if group == 1 else buf.shape[:-1]
            return [*lead, k * group, count * width], _strides(buf.shape)[:len(lead)] + [None, None]
        perm = range(buf.ndim) if perm is None else perm
        strides = _strides(buf.shape)
        return [buf.shape[p] for p in perm], [strides[p] for p in perm]

    @property
    def product(self) -> Product:
        return PRODUCTS[self.inputs[0].dtype]

    def gemm(self) -> Gemm:
        (ashape, astr), (bshape, bstr) = self.operand(0), self.operand(1)
        has_m, has_n = len(ashape) > 1, len(bshape) > 1
        k = ashape[-1]
        m, n = (ashape[-2] if has_m else 1), (bshape[-1] if has_n else 1)
        if self.panels and has_n:  # the last panel may hold zero columns past N
            n = self.out.shape[-1]
        out = self.out.shape
        batch = out[:len(out) - has_m - has_n]

        def batch_strides(shape, strides):
            lead = len(shape) - 2
            pairs = [(shape[j], strides[j]) for j in range(max(lead, 0))]
            pairs = [(1, 0)] * (len(batch) - len(pairs)) + pairs
            return tuple(0 if d == 1 else s for d, s in pairs)

        bbatch = batch_strides(bshape, bstr)
        dt = self.inputs[0].dtype  # the product's key
        if self.panels:
            b = Panels(self.inputs[1], bbatch, k, self.panels, self.product.group)
        else:
            b = Strided(self.inputs[1], bbatch, bstr[-1] if has_n else 0, bstr[-2] if has_n else bstr[-1])
        if batch and has_m and has_n and self.perms[0] is None and all(s == 0 for s in bbatch) \
                and tuple(ashape[:-2]) == tuple(batch):
            # B is shared by every batch item and A's rows are contiguous across items:
            # one tall product (linear on (batch, seq, hidden)) packs B once, not per item.
            # Not for a 1-D B: its output (*batch, M) has no N for rows_epilogue's rows
            a = Strided(self.inputs[0], (), astr[-2], astr[-1])
            c = Output(self.out, (), out[-1:] if has_n else 1)
            return Gemm(tuple(batch) + (m,), n, k, a, b, c, dt, (),
                        rows_epilogue(self, tuple(out[:-1])), stream_a=self.stream_a)
        a = Strided(self.inputs[0], batch_strides(ashape, astr), astr[-2] if has_m else 0, astr[-1])
        ostr = _strides(out)
        c = Output(self.out, tuple(ostr[:len(batch)]), out[-1:] if has_n else 1)
        # the sums are a temp only the epilogue reads when it writes elsewhere (its dtype)
        private = (has_m and has_n and self.epilogue is not None and self.epilogue_out is not None
                   and self.out.dtype == self.product.acc)
        results = [buf for buf, _ in self.epilogue_stores()] or [self.out]
        stored = min(lookup_dtype(buf.dtype).nbytes for buf in results)
        return Gemm(m, n, k, a, b, c, dt, tuple(batch),
                    box_epilogue(self, has_m, has_n), private_c=private, stored=stored,
                    stream_a=self.stream_a)

    def emit_llvm(self, ctx, b=None) -> None:
        """The product at ``ctx``'s insertion point (it runs its own ``parallel_for``): a
        call of the shared library engine when the operands are dense, else the GEMM
        driver inline. ``b``: a B operand of the engine's (:mod:`jitbyoc.engines.gemm`) to
        read instead of ``inputs[1]`` (a convolution's panels, :mod:`.conv_panels`)."""
        g = self.gemm() if b is None else replace(self.gemm(), b=b)
        (gemm_engine.call if gemm_engine.fits(g) else gemm_llvm.emit)(g, ctx)

    def macs(self) -> tuple:
        return tuple(self.out.shape) + (self.operand(0)[0][-1],)

    def needs_loop_vectorizer(self) -> bool:
        return False  # the GEMM engine's packers and microkernels are explicit vectors

    def emit_c(self, ctx) -> None:
        self.gemm().emit_c(ctx)

    @staticmethod
    def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """numpy's product; of narrower operands (:data:`PRODUCTS`), their exact values
        multiplied and summed in the accumulator's dtype (bfloat16 in float32, int8 in
        int32)."""
        product = PRODUCTS.get(str(a.dtype))
        if product is not None and not product.uniform:
            return np.matmul(a.astype(product.acc), b.astype(product.acc)).astype(product.out)
        return np.matmul(a, b)


def _check(call) -> str | None:
    x, y = call.args
    types = (str(x.ty.dtype), str(y.ty.dtype), str(call.ty.dtype))
    problem = operands_problem(call, (x, y, call), OPERANDS | RESULTS)  # then: which product
    if problem:
        return problem
    if product_of(*types) is None:
        known = ", ".join(f"{p.a} x {p.b} -> {p.out}" for p in PRODUCTS.values())
        return f"relax.matmul: no product {types[0]} x {types[1]} -> {types[2]} (known: {known})"
    xs, ys, out = dims(x.ty), dims(y.ty), dims(call.ty)
    if not xs or not ys:
        return "relax.matmul: rank-0 operand"
    k_y = ys[-2] if len(ys) > 1 else ys[0]
    if xs[-1] != k_y:
        return f"relax.matmul: cannot prove reduction dims equal ({xs[-1]} vs {k_y})"
    batch = out[:len(out) - (len(xs) > 1) - (len(ys) > 1)]
    for shape in (xs[:-2], ys[:-2]):
        problem = broadcast_problem(shape, batch)
        if problem:
            return f"relax.matmul: batch dims: {problem}"
    return None


@register("relax.matmul", 2, _check, anchor=True, composite="anchor")
def _build(fe, call, out):
    return MatMul((fe.buffer(call.args[0]), fe.buffer(call.args[1])), out)

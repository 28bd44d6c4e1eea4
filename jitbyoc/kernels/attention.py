"""Fused attention: ``softmax(Q K^T ...) V`` with the scores kept in cache.

The frontends give attention as stages of one region (the merge lets ``P @ V`` join the
scores' region, :mod:`jitbyoc.tvm.merge`): a product ``S = Q K^T`` whose epilogue scales
it and adds the mask, a softmax over its last axis, row-local stages around it (the
guard decoders put after it: ``where(row fully masked, 0, P)`` with its ``max`` over the
row), and the product ``P @ V``. :func:`fuse_attention` (a kernel rewrite) finds that
chain and replaces it by one :class:`Attention` stage, written once for both renderings
(:mod:`.attention_blocks`): each task runs on a few rows of one head; the products write
``MR`` rows of scores into a per-task block (``MR x N``, in L1/L2), the row stages run on
the block, and the products multiply the block by ``V`` into the output (in LLVM the
GEMM microkernel, in C scalar loops summing in order). Neither the scores nor the
probabilities are written to memory; grouped-query heads read their shared ``K``/``V``
through the batch strides the product already has.

Every stage of the chain must be row-local: elementwise over the scores' shape (other
operands are read broadcast, as the stage would), softmax along the last axis, and
integer max/min over the last axis (into a small per-row buffer, which stays in memory).
Anything else leaves the stages as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines.gemm import KC, Strided
from ..engines.gemm_engine import fits
from ..engines.gemm_llvm import a_in_place
from ..engines.products import UNIFORM
from ..ir import kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.ops import traps_on_masked_lanes
from ..ir.rules import rewrite
from ..render.portable import PortableStage
from .attention_blocks import emit
from .matmul import MatMul
from .reduce import Reduce
from .softmax import Softmax

ROW_KINDS = ("max", "min")  # exact folds, so a row-by-row order changes nothing


@dataclass(eq=False)
class Attention(PortableStage, kir.KernelStage):
    """``steps`` (the scores' :class:`MatMul`, the row-local stages, the :class:`MatMul`
    with ``V``) run as one; ``blocks`` are the temporaries of the scores' shape they pass
    along, which both renderings keep as per-task row blocks. ``out`` is the last
    product's (with its epilogue)."""
    steps: tuple = ()
    blocks: tuple = ()

    def reads(self) -> list[kir.Buffer]:
        inner = set(self.blocks)
        return [b for s in self.steps for b in kir.stage_reads(s) if b.storage not in inner]

    def macs(self) -> list:
        return [self.steps[0].macs(), self.steps[-1].macs()]

    def needs_loop_vectorizer(self) -> bool:
        return False

    def emit(self, e) -> None:
        emit(self, e)

    @staticmethod
    def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float = 1.0, mask=None) -> np.ndarray:
        """``softmax(scale * q @ k^T + mask) @ v`` over the last two axes."""
        s = scale * np.matmul(q, np.swapaxes(k, -1, -2))
        if mask is not None:
            s = s + mask
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        return np.matmul(p / p.sum(axis=-1, keepdims=True), v).astype(q.dtype)


class _Chain:
    """The stages between two products that pass the scores along, found backwards from
    the second product's first operand; ``ok`` is False where fusing is not safe."""

    def __init__(self, kernel: kir.Kernel, m2: MatMul):
        self.kernel, self.m2, self.m1 = kernel, m2, None
        self.stages: list = []
        self.blocks: set = set()
        self.writers: dict = {}
        for s in kernel.stages:
            for w in kir.stage_writes(s):
                self.writers.setdefault(w.storage, []).append(s)
        self.ok = m2.perms[0] is None and self._walk(m2.inputs[0].storage) and self._checked()

    def _walk(self, start: kir.Buffer) -> bool:
        todo, seen = [start], set()
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            writers = self.writers.get(t, [])
            if t not in self.kernel.temps or len(writers) != 1:
                return False
            s = writers[0]
            if isinstance(s, MatMul):
                if self.m1 is not None and s is not self.m1 or s.epilogue_out is not None:
                    return False
                self.m1 = s
                self.blocks.add(t)
                continue
            reads = self._stage(s, t)
            if reads is None:
                return False
            todo += reads
        return self.m1 is not None

    def _stage(self, s, t):
        """The temporaries ``s`` (the writer of ``t``) reads that belong to the chain, or None."""
        if s not in self.stages:
            self.stages.append(s)
        if isinstance(s, Softmax) and s.axis == s.out.ndim - 1 and not s.log:
            self.blocks.add(t)
            return [s.inputs[0].storage]
        if isinstance(s, Reduce) and s.kind in ROW_KINDS and s.axes == (s.inputs[0].ndim - 1,) \
                and s.epilogue is None and not lookup_dtype(s.out.dtype).is_float and s.out.dtype != "bool" \
                and s.out.shape[-1:] == (1,):
            return [s.inputs[0].storage]
        if isinstance(s, kir.Elementwise) and not traps_on_masked_lanes([n for _, n in s.stores]) \
                and all(dst.storage in self.kernel.temps for dst, _ in s.stores):  # outputs stay whole
            self.blocks.update(dst.storage for dst, _ in s.stores)
            return [b.storage for b in kir.stage_reads(s) if b.storage in self.kernel.temps
                    and self._belongs(b.storage, s.shape)]
        return None

    def _belongs(self, buf: kir.Buffer, shape) -> bool:
        """Whether a temporary an elementwise stage over ``shape`` reads is part of the
        chain: one of that shape, or a per-row buffer a fold over one of that shape wrote."""
        writer = self.writers.get(buf, [None])[0]
        seen = writer.inputs[0].storage if isinstance(writer, Reduce) else buf
        return kir.without_leading_ones(seen.shape) == kir.without_leading_ones(shape)

    def _checked(self) -> bool:
        k, m1, m2 = self.kernel, self.m1, self.m2
        order = {id(s): n for n, s in enumerate(k.stages)}
        if not all(order[id(m1)] < order[id(s)] < order[id(m2)] for s in self.stages):
            return False
        shapes = [t.shape for t in self.blocks] + [s.shape for s in self.stages if isinstance(s, kir.Elementwise)] \
            + [s.inputs[0].storage.shape for s in self.stages if isinstance(s, Reduce)]
        scores = kir.without_leading_ones(m1.out.storage.shape)
        if any(kir.without_leading_ones(shape) != scores for shape in shapes):
            return False
        if traps_on_masked_lanes([m1.epilogue] + [s.epilogue for s in self.stages if isinstance(s, Softmax)]):
            return False
        made = set(self.blocks) | {s.out.storage for s in self.stages if isinstance(s, Reduce)}
        inside = {id(s) for s in self.stages} | {id(m1), id(m2)}
        between = k.stages[order[id(m1)] + 1:order[id(m2)]]
        for s in k.stages:  # the blocks never leave the chain; what runs beside it is independent
            reads = {b.storage for b in kir.stage_reads(s)}
            if id(s) not in inside and (reads & set(self.blocks) or s in between and reads & made):
                return False
        return self._products_fit()

    def _products_fit(self) -> bool:
        """Both products float32, or both bfloat16 operands summed in float32 (the bf16
        mode's, :func:`jitbyoc.lower_precision`: the probabilities rounded to bfloat16 in
        the chain, ``Q`` read in place in whole pairs)."""
        m1, m2 = self.m1, self.m2
        if m1.product != m2.product or m1.out.dtype != m2.out.dtype or m1.out.dtype not in UNIFORM:
            return False
        if m2.inputs[0].storage.dtype != m1.product.a:
            return False
        g1, g2 = m1.gemm(), m2.gemm()
        if not (_dense(g1, True) and _dense(g2, False)) or isinstance(g1.m, tuple) or isinstance(g2.m, tuple):
            return False
        if tuple(g1.batch) != tuple(g2.batch) or g1.m != g2.m or g1.n != g2.k:
            return False
        if kir.without_leading_ones(m2.inputs[0].shape) != kir.without_leading_ones(m1.out.shape):
            return False
        return isinstance(g1.k, int) and 0 < g1.k <= KC


def _dense(g, a_read: bool) -> bool:
    """Whether the block's products can read ``g``'s operands: as the GEMM engine reads
    them, or for units of several k (bfloat16 pairs) strided operands, with A in whole
    units in place where it is read (``a_read``: ``Q``; the probabilities are the
    kernel's own block, padded to whole units), as the block kernels call the
    microkernels themselves."""
    if g.product.group == 1:
        return fits(g)
    return isinstance(g.a, Strided) and isinstance(g.b, Strided) and (a_in_place(g) or not a_read)


@rewrite
def fuse_attention(kernel: kir.Kernel) -> None:
    """Replace every ``softmax(Q K^T ...) @ V`` chain by one :class:`Attention` stage."""
    for m2 in [s for s in kernel.stages if isinstance(s, MatMul) and s.epilogue_out is None]:
        chain = _Chain(kernel, m2)
        if not chain.ok:
            continue
        order = {id(s): n for n, s in enumerate(kernel.stages)}
        first, last = order[id(chain.m1)], order[id(m2)]
        inside = {id(s) for s in chain.stages}
        steps = [chain.m1] + [s for s in kernel.stages[first + 1:last] if id(s) in inside] + [m2]
        beside = [s for s in kernel.stages[first + 1:last] if id(s) not in inside]
        blocks = tuple(t for t in kernel.temps if t in chain.blocks)
        stage = Attention((), m2.out, None, steps=tuple(steps), blocks=blocks)
        stage.inputs = tuple(stage.reads())
        kernel.stages[first:last + 1] = beside + [stage]
        for t in blocks:
            kernel.temps.remove(t)

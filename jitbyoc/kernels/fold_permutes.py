"""Rewrites across two kernels: a matmul reads through strides what a ``permute_dims``
would have copied (``linear``'s weight transpose then costs nothing: the GEMM packer
transposes in registers), and reads a weight packed into panels at build time as it is.
Registered with :func:`jitbyoc.ir.rules.rewrite`; they run after lowering and epilogue
fusion."""

from __future__ import annotations

from ..engines.gemm import panel_width
from ..ir import kir
from ..ir.rules import rewrite
from .layout import Permute
from .matmul import MatMul


@rewrite
def fold_permutes(kernel: kir.Kernel) -> None:
    """Make a matmul read ``x`` through strides where it read ``permute_dims(x)``'s fresh
    temporary, and drop the permute when nothing else reads its result (``linear``'s
    weight transpose then costs nothing: the packer transposes in registers)."""
    for stage in [s for s in kernel.stages if isinstance(s, MatMul)]:
        for i, buf in enumerate(stage.inputs):
            producer = next((s for s in kernel.stages if isinstance(s, Permute) and s.out == buf
                             and s.epilogue is None), None)
            if producer is None or buf not in kernel.temps:
                continue
            perm = range(buf.ndim) if stage.perms[i] is None else stage.perms[i]
            perms = list(stage.perms)
            perms[i] = tuple(producer.axes[p] for p in perm)
            inputs = list(stage.inputs)
            inputs[i] = producer.inputs[0]
            stage.inputs, stage.perms = tuple(inputs), tuple(perms)
            if not any(buf in kir.stage_reads(s) for s in kernel.stages):
                kernel.stages.remove(producer)
                kernel.temps.remove(buf)




@rewrite
def fold_panels(kernel: kir.Kernel) -> None:
    """Make a matmul read a weight packed into column panels at build time
    (:mod:`jitbyoc.tvm.linear`) in place. Its B is then ``reshape(permute_dims(P, [...,
    r + 1, r, r + 2]), (..., K, N))`` of a constant ``P`` (``..., N/w, K, w``); when ``w`` is
    the GEMM engine's panel width here, the product reads ``P``'s panels as they are and
    the permute (a copy of the whole weight) is dropped. Otherwise the permute stays: the
    product is still right, only slower."""
    for stage in [s for s in kernel.stages if isinstance(s, MatMul) and not s.panels]:
        view = stage.inputs[1]
        if stage.perms[1] is not None or view.base is None or view.base not in kernel.temps:
            continue
        r = view.ndim - 2
        producer = next((s for s in kernel.stages if isinstance(s, Permute) and s.out == view.base
                         and s.epilogue is None and tuple(s.axes) == (*range(r), r + 1, r, r + 2)), None)
        if producer is None:
            continue
        panels = producer.inputs[0]
        *lead, count, k, width = panels.shape
        if tuple(view.shape) != (*lead, k, count * width) or width != panel_width(stage.out.dtype):
            continue
        stage.inputs, stage.panels = (stage.inputs[0], panels), width
        if not any(view.base in kir.stage_reads(s) for s in kernel.stages):
            kernel.stages.remove(producer)
            kernel.temps.remove(view.base)

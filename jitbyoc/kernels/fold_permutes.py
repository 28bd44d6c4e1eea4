"""A rewrite across two kernels: a matmul reads through strides what a ``permute_dims``
would have copied (``linear``'s weight transpose then costs nothing: the GEMM packer
transposes in registers). Registered with :func:`jitbyoc.ir.rules.rewrite`; it runs after
lowering and epilogue fusion."""

from __future__ import annotations

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



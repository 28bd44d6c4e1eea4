"""A concatenation's parts that the region computes are computed where the result holds them.

``concat([a, b, c], axis)`` copies each part into its range of the result. Where every dim
before ``axis`` is 1 (a batch-1 NCHW concatenation of channels, or any concatenation on
the first dim), each part is one contiguous run of the result, so a part the region makes
itself (a temp) needs no buffer of its own: it is *placed* at its offset in the result
(:attr:`~jitbyoc.ir.kir.Kernel.placed`), its producer writes it there, and the
concatenation copies only the parts that come from outside the region (its inputs). A
result that the region returns as it is is placed in that output the same way, so nothing
copies it there. An Inception module ends with such a concatenation of its four branches:
the pooled branch's convolution wrote a temp, the concatenation copied it into a temp of
the whole map, and a last loop copied that into the region's output.

Only where placing changes nothing: a part no later stage writes (the result would change
under it), and, when the concatenation has an epilogue (which rewrites its result in
place), that no later stage reads either; a part once only, of the result's dtype, not
already placed elsewhere. Runs after every other kernel rewrite (:mod:`jitbyoc.lower`):
the renderers give a placed temp a pointer into its buffer and never allocate or free it.
"""

from __future__ import annotations

import math

from ..ir import kir
from .concat import Concat


def place_concat_parts(kernel: kir.Kernel) -> None:
    """Place every concatenation's result and parts where :func:`_contiguous_parts` allows."""
    for stage in list(kernel.stages):
        if isinstance(stage, Concat) and _contiguous_parts(stage):
            _place_result_in_output(kernel, stage)
            _place_parts(kernel, stage)


def _contiguous_parts(concat: Concat) -> bool:
    """Whether each part is one contiguous run of the result, at a static offset."""
    shapes = [concat.out.shape] + [x.shape for x in concat.inputs]
    return all(isinstance(d, int) for s in shapes for d in s) \
        and all(d == 1 for d in concat.out.shape[:concat.axis])


def _writers(stages: list, buf: kir.Buffer) -> list:
    """The stages of ``stages`` that write ``buf`` (or a view of it)."""
    return [s for s in stages if buf in {b.storage for b in kir.stage_writes(s)}]


def _place_result_in_output(kernel: kir.Kernel, concat: Concat) -> None:
    """A result that a stage only copies into a region output lives in that output."""
    result = concat.out.storage
    if result not in kernel.temps or result in kernel.placed or _writers(kernel.stages, result) != [concat]:
        return
    for s in kernel.stages[kernel.stages.index(concat) + 1:]:
        if not (isinstance(s, kir.Elementwise) and len(s.stores) == 1):
            continue
        dst, node = s.stores[0]
        if isinstance(node, kir.Load) and node.buf is result and dst in kernel.outputs \
                and (dst.shape, dst.dtype) == (result.shape, result.dtype) and _writers(kernel.stages, dst) == [s]:
            kernel.placed[result] = (dst, 0)
            kernel.stages.remove(s)
            return


def _place_parts(kernel: kir.Kernel, concat: Concat) -> None:
    later = kernel.stages[kernel.stages.index(concat) + 1:]
    storages = [x.storage for x in concat.inputs]
    placed, offset = [], 0
    for i, x in enumerate(concat.inputs):
        part = x.storage
        if part in kernel.temps and part not in kernel.placed and part is not concat.out.storage \
                and part.dtype == concat.out.dtype and storages.count(part) == 1 \
                and not _writers(later, part) \
                and (concat.epilogue is None
                     or not any(part in kir.stage_reads(s) for s in later)):
            kernel.placed[part] = (concat.out.storage, offset)
            placed.append(i)
        offset += math.prod(x.shape[concat.axis:])
    concat.placed = tuple(placed)
    if len(placed) == len(concat.inputs) and concat.epilogue is None:
        kernel.stages.remove(concat)

"""Rewrites across two kernels: a matmul reads through strides what a ``permute_dims``
would have copied (``linear``'s weight transpose then costs nothing: the GEMM packer
transposes in registers), and reads a weight packed into panels at build time as it is.
Registered with :func:`jitbyoc.ir.rules.rewrite`; they run after lowering and epilogue
fusion."""

from __future__ import annotations

from ..engines.gemm import panel_width
from ..ir import kir
from ..ir.rules import rewrite
from ..engines.products import PRODUCTS
from . import conv_panels, winograd
from .conv2d import Conv2d
from .conv_weight_units import unpacking_axes
from .layout import Permute
from .matmul import MatMul
from .slicing import Slice


@rewrite
def fold_permutes(kernel: kir.Kernel) -> None:
    """Make a matmul read ``x`` through strides where it read ``permute_dims(x)``'s fresh
    temporary, and drop the permute when nothing else reads its result (``linear``'s
    weight transpose then costs nothing: the packer transposes in registers)."""
    for stage in [s for s in kernel.stages if isinstance(s, MatMul)]:
        for i, buf in enumerate(stage.inputs):
            temp = buf.storage
            producer = permute_making(kernel, temp)
            source = None if producer is None else _unit_free(producer, buf)
            if source is None:
                continue
            src, axes = source
            perm = range(buf.ndim) if stage.perms[i] is None else stage.perms[i]
            perms = list(stage.perms)
            perms[i] = tuple(axes[p] for p in perm)
            inputs = list(stage.inputs)
            inputs[i] = src
            stage.inputs, stage.perms = tuple(inputs), tuple(perms)
            drop_if_unread(kernel, producer)


def permute_making(kernel: kir.Kernel, temp: kir.Buffer, windowed: bool = False) -> Permute | None:
    """The permute (without an epilogue; with a window only if ``windowed``) that writes
    the kernel temp ``temp``, if any."""
    if temp not in kernel.temps:
        return None
    return next((s for s in kernel.stages if isinstance(s, Permute) and s.out == temp and s.epilogue is None
                 and (windowed or not any(s.begin))), None)


def drop_if_unread(kernel: kir.Kernel, producer: kir.KernelStage) -> None:
    """Remove ``producer`` and its temp once no stage reads the temp any more."""
    if not any(producer.out in kir.stage_reads(s) for s in kernel.stages):
        kernel.stages.remove(producer)
        kernel.temps.remove(producer.out)


def _unit_free(permute: Permute, buf: kir.Buffer):
    """``(source, axes)`` with ``buf == permute_dims(source, axes)``: the permute's own
    input and axes when ``buf`` is its result, else (``buf`` a view dropping ``u`` leading
    unit dims, which the permute took from its input's first ``u`` dims: attention's
    ``K^T`` of shape ``(1, H, D, S)`` read as ``(H, D, S)``) the input without those dims;
    None otherwise."""
    src, out = permute.inputs[0], permute.out
    u = out.ndim - buf.ndim
    if buf == out:
        return src, tuple(permute.axes)
    if u <= 0 or tuple(buf.shape) != tuple(out.shape[u:]) or tuple(permute.axes[:u]) != tuple(range(u)) \
            or any(d != 1 for d in src.shape[:u]):
        return None
    return kir.view(src, src.shape[u:]), tuple(a - u for a in permute.axes[u:])


@rewrite
def fold_panels(kernel: kir.Kernel) -> None:
    """Make a matmul read a weight packed into column panels at build time
    (:mod:`jitbyoc.tvm.linear`) in place. Its B is then ``reshape(permute_dims(P, [...,
    r + 1, r, r + 2]), (..., K, N))`` of a constant ``P`` (``..., N/w, K, w``; a product in
    units of ``g`` k: ``..., N/w, K/g, w, g`` permuted by ``[..., r + 1, r + 3, r, r + 2]``); when ``w`` is
    the GEMM engine's panel width here, the product reads ``P``'s panels as they are and
    the permute (a copy of the whole weight) is dropped; a slice cutting the last panel's
    zero columns off goes too (the product reads N off its output). Otherwise the permute
    stays: the product is still right, only slower."""
    for stage in [s for s in kernel.stages if isinstance(s, MatMul) and not s.panels]:
        g = stage.product.group
        view, cut = _padding_cut(kernel, stage.inputs[1], axis=stage.inputs[1].ndim - 1)  # N padded to whole panels
        producer = None if stage.perms[1] is not None or view.base is None else permute_making(kernel, view.base)
        r = view.ndim - 2
        axes = (*range(r), r + 1, r, r + 2) if g == 1 else (*range(r), r + 1, r + 3, r, r + 2)
        if producer is None or tuple(producer.axes) != axes:
            continue
        panels = producer.inputs[0]
        *lead, count, units, width = panels.shape if g == 1 else panels.shape[:-1]
        if tuple(view.shape) != (*lead, units * g, count * width) or width != panel_width(stage.inputs[0].dtype) \
                or g > 1 and panels.shape[-1] != g:
            continue
        stage.inputs, stage.panels = (stage.inputs[0], panels), width
        if cut is not None:
            drop_if_unread(kernel, cut)
        drop_if_unread(kernel, producer)


@rewrite
def fold_conv_weights(kernel: kir.Kernel) -> None:
    """Make a convolution read a weight packed into blocks of ``J`` output channels at
    build time (:mod:`jitbyoc.tvm.conv_weights`) in place. Its weight is then
    ``reshape(permute_dims(P, [0, d, 1, ..., d - 1]), (K, Cin/groups, KH[, KW]))`` of a
    constant ``P`` (``K/J, Cin/groups, KH[, KW], J``; in units of ``u`` input channels
    ``K/J, Cin/groups/u, KH[, KW], J, u``); when ``J`` is the block of the
    engine the conv's plan calls, the engine reads ``P`` as it is and the permute (a copy
    of the whole weight) is dropped. Otherwise the permute stays: the conv is still right,
    only slower."""
    for stage in [s for s in kernel.stages if isinstance(s, Conv2d) and s.plan is not None and not s.packed]:
        view, cut = _padding_cut(kernel, stage.inputs[1])
        producer = None if view.base is None else permute_making(kernel, view.base)
        d, group = view.ndim, PRODUCTS[stage.inputs[0].dtype].group
        if producer is None or tuple(producer.axes) != tuple(unpacking_axes(d, group)):
            continue
        packed = producer.inputs[0]
        blocks, *rest, j = packed.shape if group == 1 else packed.shape[:-1]
        rest[0] *= group  # units of input channels
        ragged = cut is not None and stage.geo.groups == 1  # the last block's padding cut off
        if (blocks * j, *rest) != tuple(view.shape) or j != stage.plan.j or stage.geo.kg % j and not ragged \
                or group > 1 and packed.shape[-1] != group:
            continue
        stage.inputs, stage.packed = (stage.inputs[0], packed), True
        if cut is not None:
            drop_if_unread(kernel, cut)
        drop_if_unread(kernel, producer)


@rewrite
def fold_winograd_weights(kernel: kir.Kernel) -> None:
    """Make a convolution whose weight is ``reshape(strided_slice(P, rows p .. p + 9))`` of
    a constant ``P`` (:func:`jitbyoc.tvm.conv_weights.winograd_conv`; ``p`` a transform's
    points squared) read ``P`` whole and run by Winograd's algorithm (:mod:`.winograd`),
    with workspaces for the transformed input and the products; the slice (a copy of the
    weight) is dropped."""
    for stage in [s for s in kernel.stages if isinstance(s, Conv2d) and not (s.winograd or s.tap_major or s.packed)]:
        g, weight = stage.geo, stage.inputs[1]
        cut = next((s for s in kernel.stages if isinstance(s, Slice) and s.out == weight.storage
                    and s.epilogue is None), None)
        tf = None if cut is None else winograd.BY_ROWS.get(cut.inputs[0].shape[0])
        if tf is None or not winograd.fits(g, stage.inputs[0].dtype) or weight.storage not in kernel.temps \
                or tuple(cut.inputs[0].shape[1:]) != (g.k, g.c) or tuple(cut.begin) != (tf.points ** 2, 0, 0) \
                or any(st != 1 for st in cut.step) or tuple(cut.out.shape) != (9, g.k, g.c):
            continue
        stage.inputs, stage.winograd = (stage.inputs[0], cut.inputs[0]), True
        inputs, sums = winograd.workspaces(g, tf)
        stage.work = kir.Buffer(f"{weight.storage.name}_wino_in", inputs, stage.inputs[0].dtype)
        stage.sums = kir.Buffer(f"{weight.storage.name}_wino_sums", sums, stage.out.dtype)
        kernel.temps += [stage.work, stage.sums]
        drop_if_unread(kernel, cut)


def _padding_cut(kernel: kir.Kernel, weight: kir.Buffer, axis: int = 0):
    """``(source, slice)`` when the temp ``weight`` is only a leading slice of ``source``
    along ``axis`` (a packed weight's padding channels cut off: output channels, or a
    tap-major weight's input channels) that nothing else reads; else ``(weight, None)``."""
    cut = next((s for s in kernel.stages if isinstance(s, Slice) and s.out == weight and s.epilogue is None), None)
    others = lambda shape: tuple(d for i, d in enumerate(shape) if i != axis)  # noqa: E731
    if cut is None or weight not in kernel.temps or any(cut.begin) or any(st != 1 for st in cut.step) \
            or others(cut.inputs[0].shape) != others(weight.shape) \
            or sum(weight in kir.stage_reads(s) for s in kernel.stages) != 1:
        return weight, None
    return cut.inputs[0], cut


@rewrite
def fold_tap_major_weights(kernel: kir.Kernel) -> None:
    """Make a convolution that runs gathered on AMX tiles read its weight packed
    tap-major at build time (:func:`jitbyoc.tvm.conv_weights.tap_major_conv`): its
    weight is then ``permute_dims(P, [0, 3, 1, 2])`` of a constant ``P`` (``K, KH, KW,
    Cin``), which the product reads as its A in place, k = (ky, kx, c), while it gathers
    its columns in that order (:mod:`.conv_panels`). Its ``work`` becomes the whole panels
    (:func:`.conv_panels.whole`) or goes. On the direct tile engine
    (:func:`.conv_panels.direct`) the weight is ``reshape(permute_dims(T,
    conv_panels.TILE_AXES))`` of ``T`` packed tile by tile, read in place. Otherwise the
    conv gathers and packs as before."""
    for stage in [s for s in kernel.stages if isinstance(s, Conv2d) and s.work is not None and not s.tap_major]:
        g, dt = stage.geo, stage.inputs[1].dtype
        if not conv_panels.tap_major(g, dt):
            continue
        view, cut = _padding_cut(kernel, stage.inputs[1], axis=1)
        producer = permute_making(kernel, view.storage)
        cp = conv_panels.channels(g, dt)
        lies = g.taps == 1 and cp == g.cg  # a strided 1x1's weight is tap-major as it lies
        axes, shape = ((conv_panels.TILE_AXES, conv_panels.tile_shape(g, dt)) if conv_panels.direct(g, dt)
                       else ((0, 3, 1, 2), (g.k, g.kh, g.kw, cp)))
        if not lies and (producer is None or tuple(producer.axes) != axes
                         or tuple(producer.inputs[0].shape) != shape):
            continue
        columns, stage.work = stage.work, None
        kernel.temps.remove(columns)
        if conv_panels.whole(g) and not conv_panels.direct(g, dt):
            stage.work = kir.Buffer(f"{columns.name}_panels", conv_panels.shape(g, dt), stage.inputs[0].dtype)
            kernel.temps.append(stage.work)
        stage.tap_major = True
        stage.units = conv_panels.units_buffer(g, dt, f"{columns.name}_units")
        if stage.units is not None:
            kernel.temps.append(stage.units)
        if not lies:
            stage.inputs = (stage.inputs[0], producer.inputs[0])
            if cut is not None:
                drop_if_unread(kernel, cut)
            drop_if_unread(kernel, producer)

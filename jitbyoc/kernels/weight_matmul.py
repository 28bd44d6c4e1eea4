"""A matmul whose weight is computed as it is read: ``x @ W.T`` where ``W`` is an
elementwise expression of narrower buffers (the dequantization
:func:`jitbyoc.quantize_weights` writes: int8 or packed int4 times a scale per group, or
a bfloat16 weight widened).

The lowering makes such a weight an elementwise stage into a temp and the matmul reads
the temp (``permute_dims`` folded into its strides). :func:`fold_weight_prologue` (a
kernel rewrite, after :mod:`.fold_permutes`) gives the expression to the product
instead: each vector of a weight row is evaluated in registers from the narrow buffers,
as the seeds' fused loop nests evaluate their macros, and the float32 weight is never
written. Decoding reads a weight once per token, so its bytes are the step's time: a
little over a quarter of them for int8, about a seventh for int4 (float16 scales per 32
included).

Loops: tasks take blocks of :attr:`WeightMatMul.rows` weight rows (:data:`ROWS`; int8 on
Zen 5 :data:`WIDE_INT8_ROWS`); a block runs the rows of ``x`` in tiles of :data:`TILE`
(each weight vector evaluated once per tile, the tile's rows loaded once per weight
row), one fused multiply-add per weight vector and row of ``x`` into a vector
accumulator, whose lanes are summed at the end. A scaled weight runs in units of one
group, or of the groups one load of its storage serves (int4's words of 8 nibbles: 128
weights), the unit's vectors written out at positions that differ only in constants, so
that LLVM loads a word vector once and computes no index per vector (Zen 4, 2 threads,
one row, fed from memory, 24 layers: int4 4864 x 896 120 -> 104 us a layer; the int8
layer, whose positions had been unravelled from a flat index per group, 190 -> 158 us).
The block's weight rows stay in L1 across the tiles of a prompt, its scales widened to
float32 once (:class:`FactorRows`). The epilogue runs once
over each task's outputs of a row, after its blocks (per block of 2 a SiLU ran vectors
of 2 live lanes: the int4 layer with one 134-142 -> 115-118 us). In C every width is 1:
the same loops on scalars.

int4's cost is the decode, not the bytes. Zen 4, 2 threads, ``4864 x 896`` in int4 (in
cache), one row of x, three rounds of each in turns: as written (widen, shift left, shift
right, convert, multiply-add) 117-135 us; the same without the two shifts (wrong values,
measured only) 63 us; a ``vpermd`` table indexed by a rotate (exact) 130; offset nibbles
(shift, and, subtract) 130; the nibbles split on the 16 bytes before one sign extension
per vector 131; bytes shifted by run-time amounts 179; 256-bit vectors 136. Each 512-bit
instruction a vector costs about the same, and every exact decode takes two of them.
Since then int4's nibble values are looked up (:data:`jitbyoc.tvm.weights.NIBBLE_VALUES`;
one ``vpermps`` of a register per vector, the high nibbles shifted down first): one
thread, 262 -> 216 us. Decoding to bfloat16 pairs instead (``vpermw`` of a table of 32
words) and summing with ``vdpbf16ps`` against the row of ``x`` split in three bfloat16
parts (exact) took 295 us; in two parts (not exact) 225 (an llvmlite prototype).

Accuracy: each output sums K products of float32 values, in vector lanes and then across
them; within ``gamma_K * (|x| @ |W|.T)`` of the exact sum (as :mod:`.matmul`), ``W`` the
value the expression gives. A weight ``inner * factor`` with the factor the same over a
group (the scales) sums ``inner * x`` over each group of ``L`` and multiplies the group's
sum by the factor once: ``L + K/L + 1 <= K + 1`` roundings on each path, so within
``gamma_{K+1} * (|x| @ |W|.T)`` (times ``1 + u``: ``W``'s own rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ..engines.conv_plan import WIDE_FMA_PIPES, issue_costs
from ..ir import kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.rules import rewrite
from ..render.indexing import offset, unravel
from ..render.portable import PortableStage
from .matmul import MatMul

ROWS = 2  # weight rows (outputs) per block (int8 rows at one token: 2, 23-24 GB/s; 4, 20.5)
# int8 weight rows per block on Zen 5 (conv_plan.WIDE_FMA_PIPES): Qwen2-0.5B's decode step
# in int8, 2 threads, builds alternating: 17.11 / 18.32 ms a token with 4 against 18.94 /
# 19.85 with 2 (torch's token, the control, level); a 65536 x 896 int8 product from memory
# 56 GB/s against 43-46. int4 with 4 ran slower (11.70 / 9.88 against 8.95 / 8.41 ms)
WIDE_INT8_ROWS = 4
TILE = 4  # rows of x per tile
# rows of x up to which a product of static shape evaluates its weight in place; a
# symbolic count (a decoder's tokens) always does: one token a step
MAX_STATIC_ROWS = 32
UNROLL = 8  # vectors of a unit written out side by side (longer groups: a loop)
# how far ahead each weight row is prefetched, into L2 (prefetcht1): a decode step's
# weights come from memory. The 151936 x 896 output layer of Qwen2-0.5B in int8, one row
# of x, Zen 4, 2 threads, two rounds each: no prefetch 9.0 ms; 2048 bytes into L1 6.4,
# into L2 7.7; 4096 into L1 6.8-7.2, into L2 4.7-4.8 (32 GB/s); 8192 into L2 4.7-5.3
PREFETCH_BYTES = 4096
# on Zen 5 (conv_plan.WIDE_FMA_PIPES), by storage: 2 threads, new / old in one process, six
# rounds each, 24 products from memory (4864 x 896; 896 x 4864) and the output layer: int4
# 8192 bytes 0.87x, 0.88x, 0.87x the time of 4096, 6144 0.93x, 0.98x, 0.88x; int8 6144
# 0.96x, 0.86x, 0.99x, 8192 1.01x, 0.93x, 1.11x. Qwen2-0.5B's decode token, alternating
# runs, ms: int4 7.70 / 10.72, 7.06 / 7.70, 8.11 / 9.49; int8 15.57 / 19.42, 17.72 / 17.79,
# 17.22 / 18.69
WIDE_PREFETCH_BYTES = {"int8": 6144, "int4": 8192}
PREFETCH_LOCALITY = 2
# A scaled weight asks once per cache line of a group, before the group's loads: a
# prefetch between two loads of the same bytes (int4's two nibbles) kept LLVM from
# merging them, and a prefetch a vector asked up to four times per line. Same layer,
# three rounds each, in turns: int8 5.68 -> 4.32 ms, int4 4.68 -> 3.76 ms
LINE_BYTES = 64
# how far ahead a block's factors (FactorRows) are prefetched, into L2: Zen 5, 2 threads,
# 24 int4 products from memory, new / old in turns: none 1.02 (4864 x 896), 0.94 (896 x
# 4864); 512 bytes 0.98, 0.98; 1024 0.95, 0.92; 2048 1.00, 0.93
SCALE_PREFETCH_BYTES = 1024


@dataclass(eq=False)
class WeightMatMul(PortableStage, kir.KernelStage):
    """``out[..., n] = sum_k x[..., k] * W[n, k]``; ``inputs`` = ``(x, *buffers weight
    reads)``, ``W`` = ``weight`` (an expression over those buffers, broadcast NumPy-style
    to ``shape``) viewed as ``(shape[0], prod(shape[1:]))``."""
    weight: object = None
    shape: tuple = ()

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return prod(self.shape[1:])

    @property
    def rows(self) -> int:
        """Weight rows a block computes: :data:`ROWS`, or :data:`WIDE_INT8_ROWS` for int8
        storage on a machine of :data:`~jitbyoc.engines.conv_plan.WIDE_FMA_PIPES`."""
        wide = self.storage == "int8" and issue_costs() is WIDE_FMA_PIPES
        return WIDE_INT8_ROWS if wide else ROWS

    @property
    def storage(self) -> str:
        """``"int8"``, ``"int4"`` (words or bytes of nibbles) or ``"other"``: the
        narrowest storage the weight reads along its rows."""
        dtypes = {b.dtype for b in self.inputs[1:] if 1 not in ((a := self._aligned(b))[0], a[-1])}
        return "int8" if "int8" in dtypes else "int4" if dtypes & {"int32", "uint8"} else "other"

    @property
    def prefetch_bytes(self) -> int:
        """How far ahead the weight's rows are prefetched: :data:`PREFETCH_BYTES`, on a
        machine of :data:`~jitbyoc.engines.conv_plan.WIDE_FMA_PIPES` by storage
        (:data:`WIDE_PREFETCH_BYTES`)."""
        wide = WIDE_PREFETCH_BYTES.get(self.storage) if issue_costs() is WIDE_FMA_PIPES else None
        return wide or PREFETCH_BYTES

    def macs(self) -> tuple:
        return tuple(self.out.shape) + (self.k,)

    def needs_loop_vectorizer(self) -> bool:
        return False  # explicit vectors along k

    def emit(self, e) -> None:
        step = self.rows
        blocks = -(-self.n // step)

        def body(e, lo, hi):
            rows = e.product(self.inputs[0].shape[:-1])  # the task's own value of a symbolic size
            factors = self._factor_rows(e)
            with e.loop(hi, lo, "blk") as blk:
                n0 = e.let(e.mul(blk, step))
                weight_rows = [e.let(e.min(e.add(n0, r), self.n - 1)) for r in range(step)]
                if factors is not None:
                    factors.widen(e, weight_rows)
                tiles = e.let(e.div(rows, TILE))
                with e.loop(tiles, 0, "tile") as t:
                    self._tile(e, e.mul(t, TILE), TILE, n0, weight_rows, factors)
                with e.loop(rows, e.mul(tiles, TILE), "row") as r:
                    self._tile(e, r, 1, n0, weight_rows, factors)
            if factors is not None:
                e.free(factors.table)
            if self.epilogue is not None:  # once over the task's outputs of each row: per
                first = e.let(e.mul(lo, step))  # block of 2 a SiLU ran 2 lanes a vector
                count = e.let(e.sub(e.min(e.mul(hi, step), self.n), first))
                lead = list(self.out.shape[:-1])
                with e.when(e.lt(0, count)):
                    with e.loop(rows, 0, "er") as r:
                        origin = unravel(e, r, [e.dim(d) for d in lead]) + [first]
                        e.epilogue(self, origin, [1] * len(lead) + [count])

        e.parallel(blocks, body, True)

    def _factored(self):
        """``(inner, factor, span)`` when the weight is ``inner * factor`` with ``factor``
        the same over each ``span`` consecutive elements (a scale per group): the product
        then sums ``inner * x`` over a span and multiplies by ``factor`` once, one multiply
        a group instead of one a weight. None otherwise."""
        w = self.weight
        if not (isinstance(w, kir.Op) and w.op == "multiply" and w.in_dtype == "float32"):
            return None
        for inner, factor in (w.args, w.args[::-1]):
            t = self._uniform_dims(factor)
            if t and not self._uniform_dims(inner):
                return inner, factor, prod(self.shape[len(self.shape) - t:])
        return None

    def _factor_rows(self, e):
        """A :class:`FactorRows` for the task when the weight's factor is computed (float16
        scales widened) and stored a row after another, its groups in order; else None."""
        factored = self._factored()
        if factored is None or isinstance(factored[1], kir.Load):
            return None
        _, factor, span = factored
        lead = self._dim_holding(span)
        laid = (*self.shape[:lead], *[1] * (len(self.shape) - lead))
        if any(self._aligned(buf) != laid for buf in kir.loads([factor])):
            return None
        groups = self.k // span
        stride = -(-groups // e.lanes("float32")) * e.lanes("float32")
        return FactorRows(factor, groups, stride, e.workspace("float32", self.rows * stride))

    def _dim_holding(self, count: int) -> int:
        """The dim of ``shape`` from which the trailing dims hold ``count`` elements."""
        return next(d for d in range(len(self.shape)) if prod(self.shape[d:]) == count)

    def _uniform_dims(self, node) -> int:
        """How many trailing dims of ``shape`` ``node`` reads no load along."""
        t = len(self.shape) - 1
        for buf in kir.loads([node]):
            aligned = self._aligned(buf)
            t = min(t, next((j for j, d in enumerate(reversed(aligned)) if d != 1), t))
        return t

    def _tile(self, e, m0, tile: int, n0, rows, factors) -> None:
        """``out[m0 + i, n0 + r]`` for ``i < tile``, ``r <`` :attr:`rows` (``rows``: the
        weight rows, those past ``n`` the last row, evaluated and not stored)."""
        x, width = self.inputs[0], e.lanes("float32")
        xrows = [e.let(e.mul(e.add(m0, i), self.k)) for i in range(tile)]
        accs = self._zeros(e, tile, width, len(rows))

        def add(sums, node, k, place, prefetch=True):
            ws = [self._evaluate(e, node, place(row), width, prefetch) for row in rows]
            xs = [e.vload(x, e.add(at, k), "float32", width) for at in xrows]
            for w, row in zip(ws, sums):
                for xv, slot in zip(xs, row):
                    e.set(slot, e.vop(width, "fma", "float32", w, xv, e.get(slot)))

        factored = self._factored()
        if factored is None:
            e.strips(0, self.k, width, lambda k, _mask: add(accs, self.weight, k, self._flat(e, k)))
        else:
            self._groups(e, rows, accs, add, factors, *factored)
        for r, row in enumerate(accs):
            with e.when(e.lt(e.add(n0, r), self.n)):
                for i, slot in enumerate(row):
                    total = e.fold_vector("sum", "float32", e.get(slot), width)
                    e.store(self.out, e.add(e.mul(e.add(m0, i), self.n), e.add(n0, r)), total)

    def _groups(self, e, rows, accs, add, factors, inner, factor, span: int) -> None:
        """The products of a weight ``inner * factor``, ``factor`` the same over each
        ``span`` elements: ``inner * x`` summed over a group, times ``factor`` once. A
        unit of the loop is a group, or several where one load of the storage serves them
        (int4's words): its vectors are written out, at positions known but for the
        unit's, so that the loads of one word vector are one."""
        width = e.lanes("float32")
        unit = max(span, self._storage_run(inner))
        if unit // width > UNROLL:  # a long group: its vectors in a loop
            with e.loop(self.k // span, 0, "span") as sp:
                k0 = e.let(e.mul(sp, span))
                parts = self._zeros(e, len(accs[0]), width, len(accs))
                for row in rows:
                    self._prefetch(e, inner, self._flat(e, k0)(row), span)
                with e.loop(span // width, 0, "v") as v:
                    k = e.let(e.add(k0, e.mul(v, width)))
                    add(parts, inner, k, self._flat(e, k), False)
                self._scale(e, rows, parts, accs, factor, self._flat(e, k0), factors, sp)
            return
        lead = self._dim_holding(unit)
        with e.loop(self.k // unit, 0, "unit") as u:
            k0 = e.let(e.mul(u, unit))
            outer = unravel(e, u, list(self.shape[1:lead]))

            def at(c):
                return lambda row: [row, *outer, *(int(i) for i in np.unravel_index(c, self.shape[lead:]))]
            for row in rows:
                self._prefetch(e, inner, at(0)(row), unit)
            for g in range(0, unit, span):
                parts = self._zeros(e, len(accs[0]), width, len(accs))
                for c in range(g, g + span, width):
                    add(parts, inner, e.add(k0, c), at(c), False)
                group = e.add(e.mul(u, unit // span), g // span)  # of the row
                self._scale(e, rows, parts, accs, factor, at(g), factors, group)

    def _scale(self, e, rows, parts, accs, factor, place, factors, group) -> None:
        """``accs += parts * factor`` of each row (the factor at ``place(row)``: the
        ``group``-th of the row in ``factors``, when there are)."""
        width = e.lanes("float32")
        for r, (row, part, acc) in enumerate(zip(rows, parts, accs)):
            if factors is None:
                f = self._evaluate(e, factor, place(row), width)
            else:
                f = factors.at(e, r, group, width)
            for p, a in zip(part, acc):
                e.set(a, e.vop(width, "fma", "float32", e.get(p), f, e.get(a)))

    def _storage_run(self, node) -> int:
        """How many consecutive weight elements one position of the weight's storage (the
        buffers ``node`` reads with a row dimension) spans, trailing dims whose storage is
        broadcast included: int4's words are read for 8 runs of 16 (128)."""
        storage = [a for a in map(self._aligned, kir.loads([node])) if a[0] != 1]
        varied = [d for d in range(1, len(self.shape) - 1) if any(a[d] != 1 for a in storage)]
        return prod(self.shape[max(varied, default=0) + 1:])

    @staticmethod
    def _zeros(e, tile: int, width: int, rows: int) -> list:
        """``rows x tile`` vector accumulators, set to zero."""
        slots = [[e.vvar("float32", width) for _ in range(tile)] for _ in range(rows)]
        for slot in (s for row in slots for s in row):
            e.set(slot, e.vconst(0, "float32", width))
        return slots

    def _aligned(self, buf) -> tuple:
        return (1,) * (len(self.shape) - buf.ndim) + tuple(buf.shape)

    def _ask_ahead(self, e, buf, off) -> None:
        """Prefetch the weight bytes :attr:`prefetch_bytes` past element ``off``."""
        ask_lines(e, buf, off, 1, self.prefetch_bytes)

    def _flat(self, e, k):
        """The coordinates in ``shape`` of the weight's element ``[row, k]``, a function of
        ``row``."""
        return lambda row: [row] + unravel(e, k, list(self.shape[1:]))

    def _offset(self, e, buf, pos):
        """The element of ``buf`` (broadcast to ``shape``) at ``pos``."""
        return offset(e, self._aligned(buf), pos, broadcast=True)

    def _prefetch(self, e, node, pos, count: int) -> None:
        """Prefetch the ``count`` weight elements from ``pos`` on, of the buffers ``node``
        reads along ``k``: once per cache line (:data:`LINE_BYTES`) of their bytes there."""
        for buf in dict.fromkeys(kir.loads([node])):
            aligned = self._aligned(buf)
            if aligned[-1] != 1:
                run = max(d for d in range(len(self.shape)) if prod(self.shape[d:]) >= count)
                nbytes = prod(aligned[run:]) * lookup_dtype(buf.dtype).nbytes  # its bytes there
                ask_lines(e, buf, self._offset(e, buf, pos), nbytes, self.prefetch_bytes)

    def _evaluate(self, e, node, pos, width: int, prefetch: bool = True):
        """``node`` (the weight or a part of it) at ``pos`` and the ``width`` elements
        after it along the last dim of ``shape`` (``width`` divides that dim: the lanes
        share every other coordinate); ``prefetch``: each vector load asks for its bytes
        ahead."""

        def load(buf):
            off = self._offset(e, buf, pos)
            if self._aligned(buf)[-1] != 1:
                if prefetch:
                    self._ask_ahead(e, buf, off)
                return e.vload(buf, off, buf.dtype, width)
            return e.vbroadcast(buf, off, buf.dtype, width)

        return e.evaluate(width, [node], load)[id(node)]

    @staticmethod
    def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x @ w.T`` of the float32 weight the expression gives, summed in float64 then
        rounded (the kernel sums in float32 in its own order: see the module docstring)."""
        return np.matmul(x.astype(np.float64), w.astype(np.float64).T).astype(np.float32)


@dataclass(eq=False)
class FactorRows:
    """A scaled weight's factors (its scales) of a block's rows, evaluated into ``table``
    (``stride`` float32 a row) before the block's tiles: a float16 scale widened one
    vector of groups at a time, where each group had its own broadcast and conversion,
    and the product's multiply by a factor a broadcast load. Zen 5, 2 threads, one row
    of x, new / old in turns: 4864 x 896 in cache int4 0.84-0.85x the time, int8
    0.86-0.88x; 24 of them from memory int4 0.91-0.95x. Qwen2-0.5B's decode token
    (``bench.decoders --generate``, three pairs): int4 8.07, 8.71, 8.52 ms against 10.38,
    8.91, 11.05; int8 18.07, 18.89, 14.68 against 19.21, 18.69, 16.30."""
    factor: object
    groups: int
    stride: int
    table: object

    def widen(self, e, rows) -> None:
        """The factors of weight rows ``rows`` into the table."""
        width = e.lanes("float32")
        for r, row in enumerate(rows):
            first = e.let(e.mul(row, self.groups))
            for buf in kir.loads([self.factor]):  # the factors of rows to come
                ask_lines(e, buf, first, self.groups * lookup_dtype(buf.dtype).nbytes, SCALE_PREFETCH_BYTES)

            def put(g, mask, r=r, first=first):
                def load(buf):
                    return e.vload(buf, e.add(first, g), buf.dtype, width, mask)
                value = e.evaluate(width, [self.factor], load)[id(self.factor)]
                e.vstore(self.table, e.add(r * self.stride, g), value, "float32", mask)

            e.strips(0, self.groups, width, put)

    def at(self, e, r, group, width: int):
        """The factor of group ``group`` of the block's ``r``-th row, in ``width`` lanes."""
        return e.vbroadcast(self.table, e.add(r * self.stride, group), "float32", width)


def ask_lines(e, buf, start, nbytes: int, ahead: int) -> None:
    """Prefetch (:data:`PREFETCH_LOCALITY`) each cache line (:data:`LINE_BYTES`) of the
    ``nbytes`` bytes of ``buf`` from element ``start`` on, ``ahead`` bytes further on."""
    size = lookup_dtype(buf.dtype).nbytes
    for line in range(0, max(1, nbytes), LINE_BYTES):
        e.prefetch(buf, e.add(start, (ahead + line) // size), PREFETCH_LOCALITY)


def _narrow(expr, shape: tuple) -> bool:
    """Whether ``expr`` (of ``shape``) reads fewer bytes than its float32 result (a
    quantized or bfloat16 weight, or int4's words, each read for 8 weights): only then is
    evaluating it per tile of rows cheaper than writing it once."""
    bufs = kir.loads([expr])
    if not all(isinstance(d, int) for b in bufs for d in b.shape):
        return False
    return sum(prod(b.shape) * lookup_dtype(b.dtype).nbytes for b in bufs) < 4 * prod(shape)


def _prologue(kernel: kir.Kernel, stage: MatMul):
    """``(elementwise stage, expression)`` writing ``stage``'s weight when it can be
    evaluated in the product (see the module docstring), else None."""
    w = stage.inputs[1]
    temp = w.storage
    if temp not in kernel.temps or stage.perms[1] != (1, 0) or stage.perms[0] is not None or stage.panels:
        return None
    makers = [s for s in kernel.stages if isinstance(s, kir.Elementwise) and temp in kir.stage_writes(s)]
    if len(makers) != 1 or len(makers[0].stores) != 1 or makers[0].shape != temp.shape:
        return None
    readers = [s for s in kernel.stages if s is not stage and temp in kir.stage_reads(s)]
    (_, expr), shape = makers[0].stores[0], temp.shape
    if readers or not all(isinstance(d, int) for d in shape) or len(shape) < 2 or shape[-1] % 16 \
            or tuple(w.shape) != (shape[0], prod(shape[1:])) or not _narrow(expr, shape):
        return None
    x = stage.inputs[0]
    if all(isinstance(d, int) for d in x.shape[:-1]) and prod(x.shape[:-1]) > MAX_STATIC_ROWS:
        return None  # a product of many rows runs faster on the GEMM engine, the weight written once
    if {x.dtype, stage.out.dtype, temp.dtype} != {"float32"} or x.shape[-1] != w.shape[1] \
            or tuple(stage.out.shape) != (*x.shape[:-1], shape[0]):
        return None
    return makers[0], expr


@rewrite
def fold_weight_prologue(kernel: kir.Kernel) -> None:
    """Make a matmul evaluate a quantized weight as it reads it (the module docstring)."""
    for stage in [s for s in kernel.stages if type(s) is MatMul and s.epilogue_out is None]:  # changes below
        found = _prologue(kernel, stage)
        if found is None:
            continue
        maker, expr = found
        temp = stage.inputs[1].storage
        fused = WeightMatMul((stage.inputs[0], *kir.loads([expr]), *kir.tables([expr])), stage.out,
                             stage.epilogue, weight=expr, shape=temp.shape)
        if hasattr(stage, "origin"):
            fused.origin = stage.origin
        kernel.stages[kernel.stages.index(stage)] = fused
        kernel.stages.remove(maker)
        kernel.temps.remove(temp)

"""Kernel IR -> LLVM IR (llvmlite.ir): the compute function of a region.

Stages run in order inside ``<name>_compute``; temporaries come from TVM's workspace
allocator. Kernels emit through a :class:`Ctx`, which also gives them the two shared
pieces: :meth:`Ctx.parallel_for` (TVM's runtime thread pool) and :meth:`Ctx.epilogue`
(the fused elementwise tail applied to a block of a kernel's output).

Fused elementwise code is written with explicit vectors where every buffer it touches
holds 32- or 64-bit elements (the op table's rules take vector dtypes as well as
scalars). The module records whether anything in it still relies on LLVM's loop
vectorizer (``module.needs_loop_vectorizer``: a scalar fallback, or a kernel whose
:meth:`~jitbyoc.ir.kir.KernelStage.needs_loop_vectorizer` says so); a region that needs
nothing from it skips that pass, the costliest in its compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

from llvmlite import ir

from ..ir import bfloat, kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.errors import RenderError, error_context
from ..ir.llvmtypes import I8, I32, I64, PTR, declare
from ..ir.ops import op_def, traps_on_masked_lanes
from . import isa
from .indexing import Indexing, LLVMInts, dot, product
from .loops import AtRunTime, for_range, loop_nest, threaded
from .vectors import SplatConstant, lanes, splat, strips, vload, vlookup, vstore


class Emitter:
    """Emits table ops through the llvmlite builder (the interface expansions use), on
    scalars or, with ``lanes`` > 1, on vectors of that many elements."""

    def __init__(self, b: ir.IRBuilder, lanes: int = 1):
        self.b, self.lanes = b, lanes
        self.fused = isa.has_fma()  # expansions may use the ``fma`` row (one rounding, fast)

    def const(self, value, dt: str):
        d = lookup_dtype(dt)
        scalar = ir.Constant(d.ir, bfloat.bits(value) if d.is_bfloat else d.held(value))
        made = scalar if self.lanes == 1 else SplatConstant(scalar, self.lanes)
        made.literal = value
        return made

    @staticmethod
    def known(value):
        """The number a literal made by :meth:`const` stands for; None for any other value
        (expansions specialize on it: ``power``'s exponent)."""
        return getattr(value, "literal", None)

    def ldexp(self, dt: str, y, n):
        """``y * 2**n`` (``n`` an integer of ``y``'s width, in the normal exponent range) as
        ``llvm.ldexp``, which LLVM lowers to AVX-512's ``vscalefps``/``vscalefpd`` (with
        the integer's conversion: two instructions where the split of
        :func:`jitbyoc.ir.vecmath._ldexp` takes nine), or None without AVX-512 (there it
        becomes a call of libm's ldexp). Either way one rounding: the same result."""
        d = lookup_dtype(dt)
        if not isa.current().has("avx512f") or d.bits not in (32, 64):
            return None
        wide = ir.VectorType(I32, self.lanes) if self.lanes > 1 else I32
        if d.bits == 64:
            n = self.b.trunc(n, wide)
        shape = f"v{self.lanes}" if self.lanes > 1 else ""
        fn = declare(self.b.module, f"llvm.ldexp.{shape}f{d.bits}.{shape}i32", y.type, [y.type, wide])
        return self.b.call(fn, [y, n])

    def op(self, name: str, dt: str, *args, **attrs):
        row = op_def(name, dt)
        if row.expand is not None:
            return row.expand(self, dt, *args, **attrs)
        return row.llvm(self.b, lookup_dtype(dt).with_lanes(self.lanes), *args, **attrs)

    def loaded(self, raw, dt: str):
        """A loaded element as a value: bytes of a bool become i1."""
        return lookup_dtype(dt).loaded_llvm(self.b, raw)


def release(module: ir.Module) -> None:
    """Break an llvmlite module's reference cycles (parents, phi incomings, metadata) once
    its text is taken, so it is freed when dropped rather than by a cyclic collection:
    after a cold build of the encoder, that collection took 20-27 ms."""
    for g in list(module.globals.values()):
        for block in getattr(g, "blocks", ()):
            for ins in block.instructions:
                ins.__dict__.clear()
            block.__dict__.clear()
        for arg in getattr(g, "args", ()):
            arg.__dict__.clear()
        g.__dict__.clear()
    module.__dict__.clear()


def pack_slots(b: ir.IRBuilder, values) -> ir.Value:
    """``values`` (i64 values, ints or pointers) stored in i64 slots of a static stack
    array (valid while the current function runs); read back with :func:`load_slots`."""
    with b.goto_block(b.function.entry_basic_block):  # a static alloca, even inside loops
        data = b.alloca(I64, size=max(1, len(values)))
    for k, v in enumerate(values):
        v = ir.Constant(I64, v) if not isinstance(v, ir.Value) else v if v.type == I64 else b.ptrtoint(v, I64)
        b.store(v, b.gep(data, [I64(k)], source_etype=I64))
    return data


def load_slots(b: ir.IRBuilder, data, count: int, start: int = 0) -> list:
    """Slots ``start .. start + count`` of an array made by :func:`pack_slots`."""
    return [b.load(b.gep(data, [I64(k)], source_etype=I64), typ=I64) for k in range(start, start + count)]


evaluate = kir.evaluate


@dataclass
class Facts:
    """What rendering a module found out, returned with it (never stored on the module)."""
    needs_loop_vectorizer: bool = False  # loops are left for LLVM's loop vectorizer


class Team:
    """The task a :meth:`Ctx.parallel_for` body runs as (``ctx.team`` there): its index
    and the number of tasks of the launch (i64 values)."""

    def __init__(self, index, size):
        self.index, self.size = index, size


class Ctx(Indexing):
    """What a stage emits with: builder, buffer pointers, symbolic sizes, and the
    :class:`Facts` of the module being rendered (shared by every ctx of that module).
    Index arithmetic (``dim``, ``product``, ``unravel``, ``offset``; ``ints``, folding
    i64 arithmetic) comes from :mod:`.indexing`."""

    def __init__(self, module: ir.Module, b: ir.IRBuilder, name: str, ptrs: dict, syms: dict,
                 facts: Facts | None = None):
        self.module, self.b, self.name, self.ptrs, self.syms = module, b, name, ptrs, syms
        self.facts = facts if facts is not None else Facts()
        self.em = Emitter(b)

    @property
    def ints(self) -> LLVMInts:
        """The index arithmetic over this ctx, made per use: stored, it and the ctx would
        be a cycle that keeps the llvmlite module alive until a cyclic collection."""
        return LLVMInts(self)

    def scalar_loops(self) -> None:
        """Note that this module has loops left for LLVM's loop vectorizer."""
        self.facts.needs_loop_vectorizer = True

    def i64(self, v) -> ir.Value:
        return self.ints.i(v)

    def element(self, buf: kir.Buffer, offset) -> ir.Value:
        """Pointer to element ``offset`` (i64) of ``buf`` (a view addresses its base)."""
        return self.b.gep(self.ptrs[buf.storage], [offset], source_etype=lookup_dtype(buf.dtype).storage_ir,
                          inbounds=True)

    def load(self, buf: kir.Buffer, offset) -> ir.Value:
        return self.b.load(self.element(buf, offset), typ=lookup_dtype(buf.dtype).storage_ir)

    def store(self, buf: kir.Buffer, offset, value) -> None:
        self.b.store(lookup_dtype(buf.dtype).stored_llvm(self.b, value), self.element(buf, offset))

    def lookup(self, table: kir.Buffer, index) -> ir.Value:
        """The raw element(s) of ``table`` at ``index``: a scalar, or every lane of a vector."""
        if isinstance(index.type, ir.VectorType):
            return vlookup(self.b, self.element(table, I64(0)), index, table.dtype, table.shape[0])
        return self.load(table, index if index.type == I64 else self.b.sext(index, I64))

    def row_lookup(self, table: kir.Buffer, index, byte, base) -> ir.Value:
        """:meth:`lookup` of a lookup with :attr:`~jitbyoc.ir.kir.Lookup.rows`: where ``base``
        is one value ``s`` across the vector (a splat), ``0 <= s <= n - 256`` and the table
        holds bytes, :func:`.vectors.vlookup` of ``byte`` in the 256 entries from
        ``table[s]`` (four registers, ``vpermi2b`` on AVX512_VBMI); else :meth:`lookup`."""
        b, s, n = self.b, getattr(base, "splat_of", None), table.shape[0]
        if s is None or lookup_dtype(table.dtype).storage_bits != 8 or not isinstance(n, int) or n < 256 \
                or not isa.current().has("avx512vbmi"):
            return self.lookup(table, index)
        s = b.sext(s, I64) if s.type.width < 64 else s
        inside = b.and_(b.icmp_signed(">=", s, I64(0)), b.icmp_signed("<=", s, I64(n - 256)))
        with b.if_else(inside) as (one_row, anywhere):
            with one_row:
                row = vlookup(b, self.element(table, s), byte, table.dtype, 256)
                row_end = b.block
            with anywhere:
                whole = self.lookup(table, index)
                whole_end = b.block
        picked = b.phi(row.type)
        picked.add_incoming(row, row_end)
        picked.add_incoming(whole, whole_end)
        return picked

    # ---- closures ------------------------------------------------------------------------------
    def closure(self, extra=()) -> ir.Value:
        """This ctx's buffer pointers and sizes, then ``extra`` (i64 values), packed in
        i64 slots on the stack (valid while the current function runs); read them back
        with :meth:`reopen`."""
        return pack_slots(self.b, list(self.ptrs.values()) + list(self.syms.values()) + list(extra))

    def reopen(self, b: ir.IRBuilder, data, extra, emit) -> ir.Value:
        """Call ``emit(ctx, extra)`` where ``ctx`` is the ctx packed by :meth:`closure` at
        ``data``, in a function emitted with ``b``. ``emit`` runs in an internal function
        inlined into ``b``'s, whose buffer pointers are ``noalias`` arguments: the inliner
        turns them into alias scopes, so a loop of a threaded body keeps its loads of
        scalars (scales, zero points) out of the loop, as it does in the kernel's own
        function. Pointers read back from the slots alone could alias any store (a uint8
        zero point beside a uint8 output was read again for every vector). Returns the
        i32 the function returns (0, or what ``emit`` returns early)."""
        vals = load_slots(b, data, len(self.ptrs) + len(self.syms))
        npt = len(self.ptrs)
        args = [b.inttoptr(v, PTR) for v in vals[:npt]] + vals[npt:] + list(extra)
        fn = ir.Function(self.module, ir.FunctionType(I32, [PTR] * npt + [I64] * (len(args) - npt)),
                         f"{b.function.name}_body")
        fn.linkage = "internal"
        fn.attributes.add("alwaysinline")
        for arg in fn.args[:npt]:
            arg.add_attribute("noalias")
        inner = ir.IRBuilder(fn.append_basic_block("entry"))
        child = Ctx(self.module, inner, self.name, dict(zip(self.ptrs, fn.args)),
                    dict(zip(self.syms, fn.args[npt:])), self.facts)
        emit(child, list(fn.args[npt + len(self.syms):]))
        inner.ret(I32(0))
        _check_own_values(fn)
        return b.call(fn, args)

    def outline(self, kind: str, nargs: int, body) -> tuple[ir.Function, ir.Value]:
        """An internal ``void fn(ptr env, i64 x nargs)`` whose body is ``body(ctx, args)``
        (``ctx`` sees this ctx's buffers and sizes through ``env``), and the ``env`` to
        call it with: how a library engine calls back into its region (epilogues)."""
        module = self.module
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR] + [I64] * nargs),
                         f"{self.name}_{kind}{sum(1 for g in module.globals if f'_{kind}' in g)}")
        fn.linkage = "internal"
        env = self.closure()
        cb = ir.IRBuilder(fn.append_basic_block("entry"))
        self.reopen(cb, fn.args[0], fn.args[1:], body)
        cb.ret_void()
        return fn, env

    # ---- threads -------------------------------------------------------------------------------
    def parallel_for(self, count, body, extra=(), tasks=None, threads=True) -> None:
        """Run ``body(ctx, lo, hi, extra)`` over [0, count) split across TVM's thread pool
        (``TVMBackendParallelLaunch``, which honours ``TVM_NUM_THREADS``). ``body`` emits
        into an outlined function; ``extra`` are i64 values it needs from here. ``tasks``
        (an i32 value; default 0, every thread) 1 runs the body on the calling thread.
        With ``threads`` an :class:`~.loops.AtRunTime` (what :func:`~.loops.threaded` gives a
        symbolic size): when its size is small at run time the body is called directly as
        the one task, with no launch."""
        b, module = self.b, self.module
        fn = ir.Function(module, ir.FunctionType(I32, [I32, PTR, PTR]),
                         f"{self.name}_par{sum(1 for g in module.globals if '_par' in g)}")
        fn.linkage = "internal"
        cdata = self.closure([count] + list(extra))
        launch = declare(module, "TVMBackendParallelLaunch", I32, [PTR, PTR, I32])
        num_task = I32(0) if tasks is None else tasks
        if not isinstance(threads, AtRunTime):
            rc = b.call(launch, [fn, cdata, num_task])
        else:
            with b.if_else(threads.small(self)) as (alone, pooled):
                with alone:  # TVMParallelGroupEnv {sync_handle, num_task}: no handle, one task
                    rc_alone, at_alone = b.call(fn, [I32(0), pack_slots(b, [0, 1]), cdata]), b.block
                with pooled:
                    rc_pooled, at_pooled = b.call(launch, [fn, cdata, num_task]), b.block
            rc = b.phi(I32)
            rc.add_incoming(rc_alone, at_alone)
            rc.add_incoming(rc_pooled, at_pooled)
        with b.if_then(b.icmp_signed("!=", rc, I32(0)), likely=False):
            b.ret(I32(-1))
        task, penv, data = fn.args
        cb = ir.IRBuilder(fn.append_basic_block("entry"))
        n, *more = load_slots(cb, data, 1 + len(extra), len(self.ptrs) + len(self.syms))
        num = cb.sext(cb.load(cb.gep(penv, [I64(8)], source_etype=I8), typ=I32), I64)
        t = cb.sext(task, I64)
        lo = cb.sdiv(cb.mul(n, t), num)
        hi = cb.sdiv(cb.mul(n, cb.add(t, I64(1))), num)

        def emit(child, args):
            t, num, lo, hi, *more = args
            child.team = Team(t, num)
            body(child, lo, hi, more)

        cb.ret(self.reopen(cb, data, [t, num, lo, hi, *more], emit))
        _check_own_values(fn)

    # ---- fused epilogues -------------------------------------------------------------------
    def epilogue(self, stage: kir.KernelStage, origin, extent, acc=None) -> None:
        """Apply ``stage.epilogue`` in place to the box ``origin + [0, extent)`` of
        ``stage.out`` (one origin/extent per dim of ``out``; ints or i64 values). ``acc``:
        ``(pointer, row stride)``, the box's sums are there instead of in ``out`` (a
        product's scratch, :mod:`jitbyoc.engines.gemm_llvm`), rows along ``out``'s
        second-last dim; ``(pointer, row stride, dim)``: rows along ``dim`` (a direct
        convolution's output channels, :mod:`jitbyoc.engines.conv_tiles`)."""
        stores = stage.epilogue_stores()
        if not stores:
            return
        roots = [e for _, e in stores]
        reads = kir.loads(roots)
        # a run is the trailing dims the box spans whole: 7-wide rows of a 7x7 map are
        # 49-long runs, vectors (not scalar loops: EfficientNet's SiLU after its 7x7
        # convs cost more than the convs); a scratch's rows are runs of their own
        runs = 1 if acc is not None else _run_dims(stage.out, reads, origin, extent)
        lead = stage.out.ndim - runs
        n = vector_lanes(stage.out, reads + [buf for buf, _ in stores], stage.out.shape[lead:], roots,
                         lambda buf: _walks(stage.out, buf, stage.out.ndim - 1))
        if n and _byte_runs(stores, extent[lead:], stage.out.shape[lead:]):
            n = lanes("int8")
        if n:
            self._vector_epilogue(stage, stores, origin, extent, n, lead, acc)
            return
        self.scalar_loops()
        out, b = stage.out, self.b
        nd = out.ndim
        with loop_nest(b, [self.i64(e) for e in extent], "e") as idx:
            pos = [b.add(self.i64(o), i) for o, i in zip(origin, idx)]
            offset = self.offset(out.shape, pos)

            def load(buf):
                sub = pos[nd - buf.ndim:]
                return self.em.loaded(self.load(buf, self.offset(buf.shape, sub, broadcast=True)), buf.dtype)

            at = self.element(out, offset) if acc is None else _scratch_at(b, acc, idx, out.dtype)
            value = self.em.loaded(b.load(at, typ=lookup_dtype(out.dtype).storage_ir), out.dtype)
            values = evaluate(self.em, roots, load, value, self.lookup)
            for buf, expr in stores:
                self.store(buf, offset, values[id(expr)])

    def _vector_epilogue(self, stage: kir.KernelStage, stores, origin, extent, n: int, lead: int,
                         acc=None) -> None:
        """:meth:`epilogue` on ``n``-element vectors along runs of the box that are
        contiguous in ``out`` (the dims from ``lead`` on, :func:`_run_dims`: the last dim,
        and the dims before it while the box spans the dims after them whole: a 4-row band
        of 56-wide image rows is one run of 14 vectors, not 4 runs of 3.5), the last
        vector of each run masked. ``stores``: the epilogue's (:meth:`epilogue`)."""
        out, b, em = stage.out, self.b, Emitter(self.b, n)
        nd = out.ndim
        sizes = [_static(e) if _static(e) is not None else e for e in extent[lead:]]
        length = self.i64(product(self.ints, sizes))

        def point(idx, j, mask):
            start = [b.add(self.i64(o), i) for o, i in zip(origin, idx)] + list(map(self.i64, origin[lead:]))

            def load(buf):
                off = self.offset(buf.shape, start[nd - buf.ndim:], broadcast=True)
                if not _walks(out, buf, nd - 1):  # constant along the run
                    return splat(b, self.em.loaded(self.load(buf, off), buf.dtype), n)
                return vload(b, self.element(buf, b.add(off, j)), buf.dtype, mask, n)

            at = b.add(self.offset(out.shape, start), j)
            sums = self.element(out, at) if acc is None else _scratch_at(b, acc, list(idx) + [j], out.dtype)
            values = evaluate(em, [e for _, e in stores], load, vload(b, sums, out.dtype, mask, n), self.lookup,
                              self.row_lookup)
            for buf, expr in stores:
                vstore(b, values[id(expr)], self.element(buf, at), buf.dtype, mask)

        with loop_nest(b, [self.i64(e) for e in extent[:lead]], "e") as idx:
            strips(b, I64(0), length, n, lambda j, mask: point(idx, j, mask))


def _check_own_values(fn: ir.Function) -> None:
    """A threaded body must compute what it uses (sizes included) in its own function: a
    value of the launching function is undefined there, which LLVM rejects at parse time
    with no word of the kernel (symbolic sizes; static ones are constants)."""
    for block in fn.blocks:
        for inst in block.instructions:
            for v in getattr(inst, "operands", ()):
                owner = v.parent.parent if isinstance(v, ir.Instruction) else \
                    v.parent if isinstance(v, ir.Argument) else fn
                if owner is not fn:
                    raise RenderError(f"{fn.name}: a threaded body uses {v.get_reference()} of "
                                      f"{owner.name}, which is undefined in it")


def vector_lanes(out: kir.Buffer, bufs, inner, exprs=(), walks=None) -> int | None:
    """Lanes for an explicitly vectorized loop writing ``out`` along dims ``inner`` (a
    tuple of dims), touching ``bufs`` and computing ``exprs``; None for a scalar loop:
    the loop must not be short, no op may trap on the masked-off lanes of a tail (integer
    division by their zeros), and every buffer must hold 32- or 64-bit elements, or 8- or
    16-bit integers (a quantized graph's uint8 tensors), or, when ``walks(buffer)`` says
    it is constant along the loop (one element, splatted), anything but a bool. Vectors
    have ``out``'s lanes, or 16 for a narrower ``out``."""
    if not inner or traps_on_masked_lanes(exprs):
        return None
    moved = [x for x in [out, *bufs] if x is out or walks is None or walks(x)]
    if any(not _vector_element(lookup_dtype(x.dtype), x in moved) for x in [out, *bufs]):
        return None
    bits = lookup_dtype(out.dtype).storage_bits
    n = lanes(out.dtype) if bits >= 32 else lanes("int32")
    static = all(isinstance(d, int) for d in inner)
    return None if static and reduce(lambda x, y: x * y, inner, 1) < n // 2 else n


# runs of at least this many bytes take 64 lanes (:func:`_byte_runs`)
BYTE_RUN_MIN = 2048


def _byte_runs(stores, run, whole) -> bool:
    """Whether an epilogue that stores only bytes (a quantized graph's requantization)
    runs on vectors of one byte register's lanes: four float vectors a step, one byte
    lookup and one tie check a step instead of four, on runs of :data:`BYTE_RUN_MIN` or
    more (``run``'s extents, or where they are known at run time only, ``whole``'s). AMX
    Xeon, region by region in ResNet-50 QDQ, 16 -> 64 lanes: its 56x56 maps' regions
    0.83-0.95x the time, the 28x28 and 14x14 ones 1.01-1.04x (Inception v1 QDQ, all of them
    small maps, 1.037x): the model 0.97x with 64 lanes from 2048 elements on."""
    sizes = [_static(e) for e in run]
    sizes = sizes if None not in sizes else [_static(e) for e in whole]
    return (all(lookup_dtype(buf.dtype).storage_bits == 8 for buf, _ in stores)
            and None not in sizes and reduce(lambda x, y: x * y, sizes, 1) >= BYTE_RUN_MIN)


def _vector_element(dt, moved: bool) -> bool:
    """Whether a buffer of ``dt`` can take part in an explicit vector loop: loaded or
    stored as vectors (``moved``), or loaded once and splatted."""
    if dt.storage_bits in (32, 64):
        return True
    return not dt.is_bool and (dt.kind == "int" or not moved)


def _walks(out: kir.Buffer, buf: kir.Buffer, d: int) -> bool:
    """Whether ``buf``, broadcast against ``out``, varies along ``out``'s dim ``d``."""
    j = d - (out.ndim - buf.ndim)
    return j >= 0 and buf.shape[j] != 1


def _static(v):
    """``v`` (an int or i64 value) as an int if it is a constant, else None."""
    return v if isinstance(v, int) else v.constant if isinstance(v, ir.Constant) else None


def _scratch_at(b: ir.IRBuilder, acc, idx: list, dt: str) -> ir.Value:
    """The element at the box index ``idx`` (one per dim of ``out``) of its sums kept in a
    scratch: ``acc = (pointer, row stride[, row dim])`` (see :meth:`Ctx.epilogue`)."""
    pointer, stride, *dim = acc
    row = idx[dim[0] if dim else len(idx) - 2]
    return b.gep(pointer, [b.add(b.mul(row, stride), idx[-1])], source_etype=lookup_dtype(dt).storage_ir)


def _run_dims(out: kir.Buffer, reads, origin, extent) -> int:
    """How many trailing dims of the box ``origin + [0, extent)`` of ``out`` form one
    contiguous run that every buffer in ``reads`` walks alike (contiguously, or not at all)."""
    nd, m = out.ndim, 1
    while m < nd:
        d = nd - m
        if _static(extent[d]) != out.shape[d] or _static(origin[d]) != 0:
            break
        if any(_walks(out, buf, d - 1) != _walks(out, buf, d) for buf in reads):
            break
        m += 1
    return m


def _emit_point(c: Ctx, stage: kir.Elementwise, roots, n, steps, idx, mask=None) -> None:
    """An elementwise nest's body at ``idx``; with ``n``, on the vector starting there."""
    b, em = c.b, Emitter(c.b, n) if n else c.em
    offsets: dict = {}

    def address(buf):  # one offset per buffer and point (steps: ints fold)
        if buf not in offsets:
            walked = [(i, step) for i, step in zip(idx, steps[buf]) if step is not None]
            offsets[buf] = c.i64(dot(c.ints, [i for i, _ in walked], [step for _, step in walked]))
        return offsets[buf]

    def load(buf):
        if not n:
            return c.load(buf, address(buf))
        if steps[buf][-1] is None:  # constant along the vector
            return splat(b, c.load(buf, address(buf)), n)
        return vload(b, c.element(buf, address(buf)), buf.dtype, mask, n)

    values = evaluate(em, roots, load, lookup=c.lookup, row_lookup=c.row_lookup if n else None)
    for buf, node in stage.stores:
        if n:
            vstore(b, values[id(node)], c.element(buf, address(buf)), buf.dtype, mask)
        else:
            c.store(buf, address(buf), values[id(node)])


def emit_elementwise(ctx: Ctx, stage: kir.Elementwise) -> None:
    """The stage as one loop nest (dims that every buffer walks alike merged into one
    loop), the outermost loop split across threads when the nest is large. The innermost
    loop runs on ``n``-element vectors (the last one masked) when :func:`vector_lanes`
    allows, with buffers that do not walk it loaded once and splatted."""
    roots = [node for _, node in stage.stores]
    bufs = kir.loads(roots) + [buf for buf, _ in stage.stores]
    layout = kir.nest_layout(stage.shape, bufs)
    n = layout.extents and vector_lanes(stage.stores[0][0], bufs, layout.extents[-1], roots,
                                        lambda buf: layout.strides[buf][-1] is not None)
    if not n:
        ctx.scalar_loops()

    def point(c: Ctx, steps, idx, mask=None) -> None:
        _emit_point(c, stage, roots, n, steps, idx, mask)

    def vectors(c: Ctx, steps, start, stop, idx) -> None:
        strips(c.b, start, stop, n, lambda i, mask: point(c, steps, idx + [i], mask))

    def nest(c: Ctx, lo, hi, _extra):
        b = c.b
        counts = [c.product(ext) for ext in layout.extents]
        steps = {buf: [None if s is None else c.ints.product(s) for s in layout.strides[buf]] for buf in bufs}
        if not counts:
            point(c, steps, [])
        elif n and len(counts) == 1:
            vectors(c, steps, lo, hi, [])
        else:
            with for_range(b, hi, "i0", start=lo) as first:
                with loop_nest(b, counts[1:-1] if n else counts[1:], "j") as rest:
                    if n:
                        vectors(c, steps, I64(0), counts[-1], [first] + rest)
                    else:
                        point(c, steps, [first] + rest)

    outer = ctx.product(layout.extents[0]) if layout.extents else ir.Constant(I64, 1)
    threads = threaded([d for ext in layout.extents for d in ext], "elementwise") if layout.extents else False
    if threads:
        ctx.parallel_for(outer, nest, threads=threads)
    else:
        nest(ctx, ir.Constant(I64, 0), outer, ())


def _emit_stage(ctx: Ctx, stage) -> None:
    if isinstance(stage, kir.Elementwise):
        emit_elementwise(ctx, stage)
    else:
        if stage.needs_loop_vectorizer():
            ctx.scalar_loops()
        stage.emit_llvm(ctx)


def emit_compute(module: ir.Module, kernel: kir.Kernel) -> tuple[ir.Function, Facts]:
    """``<name>_compute``, the kernel's stages in order, and what rendering them found."""
    syms = kernel.sym_vars
    fnty = ir.FunctionType(I32, [PTR] * len(kernel.params) + [I64] * len(syms))
    fn = ir.Function(module, fnty, f"{kernel.name}_compute")
    fn.linkage = "internal"
    for arg, buf in zip(fn.args, kernel.params):
        arg.name = buf.name
        arg.add_attribute("noalias")
    for arg, s in zip(fn.args[len(kernel.params):], syms):
        arg.name = s
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ctx = Ctx(module, b, kernel.name, dict(zip(kernel.params, fn.args)),
              dict(zip(syms, fn.args[len(kernel.params):])))
    alloc = declare(module, "TVMBackendAllocWorkspace", PTR, [I32, I32, I64, I32, I32])
    free = declare(module, "TVMBackendFreeWorkspace", I32, [I32, I32, PTR])
    allocated = kir.allocated_temps(kernel)
    for t in allocated:
        d = lookup_dtype(t.dtype)
        nbytes = b.mul(ctx.product(t.shape), I64(d.nbytes))
        ptr = b.call(alloc, [I32(1), I32(0), nbytes, I32(d.dl_code), I32(d.storage_bits)])
        with b.if_then(b.icmp_unsigned("==", b.ptrtoint(ptr, I64), I64(0)), likely=False):
            b.ret(I32(-1))  # TVM's allocator has set the error
        ctx.ptrs[t] = ptr
    for t in kir.placed_in_order(kernel):
        dest, offset = kernel.placed[t]
        ctx.ptrs[t] = b.gep(ctx.ptrs[dest], [I64(offset)], source_etype=lookup_dtype(t.dtype).storage_ir)
    for stage in kernel.stages:
        with error_context(RenderError, kernel.name, f"{kir.describe(stage)} in LLVM"):
            _emit_stage(ctx, stage)
    for t in reversed(allocated):
        b.call(free, [I32(1), I32(0), ctx.ptrs[t]])
    b.ret(I32(0))
    return fn, ctx.facts

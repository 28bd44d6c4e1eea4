"""Loop helpers for llvmlite builders (and TVM's workspace pool, which the engines' and
kernels' tasks take their scratch from). Op rules never build loops; these do."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I1, I8, I32, I64, PTR, declare
from .isa import VECTOR_BYTES


def ceil_div(b: ir.IRBuilder, x, y):
    """``ceil(x / y)`` of positive i64 values."""
    return b.sdiv(b.add(x, b.sub(y, ir.Constant(I64, 1))), y)


def smin(b: ir.IRBuilder, x, y):
    return b.select(b.icmp_signed("<", x, y), x, y)


def smax(b: ir.IRBuilder, x, y):
    return b.select(b.icmp_signed(">", x, y), x, y)


@contextmanager
def for_range(b: ir.IRBuilder, count, name: str = "i", start=None):
    """``for (i = start; i < count; ++i)``; yields ``i`` with the builder in the body.
    Emitted rotated (a guard, then a bottom-tested body): the canonical form that loop
    passes and the code generator's strength reduction expect."""
    start = ir.Constant(I64, 0) if start is None else start
    pre = b.block
    body = b.append_basic_block(f"{name}.body")
    end = b.append_basic_block(f"{name}.end")
    if isinstance(start, ir.Constant) and isinstance(count, ir.Constant) and start.constant < count.constant:
        b.branch(body)  # runs at least once
    else:
        b.cbranch(b.icmp_signed("<", start, count), body, end)
    b.position_at_end(body)
    idx = b.phi(I64, name=name)
    idx.add_incoming(start, pre)
    yield idx
    nxt = b.add(idx, ir.Constant(I64, 1), name=f"{name}.next", flags=["nsw"])
    idx.add_incoming(nxt, b.block)
    b.cbranch(b.icmp_signed("<", nxt, count), body, end)
    b.position_at_end(end)


@contextmanager
def loop_nest(b: ir.IRBuilder, counts, name: str = "i"):
    """Nested :func:`for_range` loops, outermost first; yields the list of indices."""
    if not counts:
        yield []
        return
    with for_range(b, counts[0], f"{name}{len(counts) - 1}") as i:
        with loop_nest(b, counts[1:], name) as rest:
            yield [i] + rest


def task_counter(b: ir.IRBuilder) -> ir.Value:
    """A zeroed i64 counter (a static stack slot), as the i64 address the tasks of a
    ``parallel_for`` share to claim work with :func:`claim_each`."""
    with b.goto_block(b.function.entry_basic_block):  # a static alloca, even inside loops
        counter = b.alloca(I64)
    b.store(ir.Constant(I64, 0), counter)
    return b.ptrtoint(counter, I64)


@contextmanager
def claim_each(b: ir.IRBuilder, counter, total, name: str = "task"):
    """``while ((t = counter++) < total)`` with an atomic increment: the body (yielded
    ``t``) runs for every piece of work this task claims. A task that the OS preempts (a
    busy machine) then delays one piece, not a fixed share of them."""
    shared = b.inttoptr(counter, PTR)
    take, body, done = (b.append_basic_block(f"{name}.{s}") for s in ("take", "body", "done"))
    b.branch(take)
    b.position_at_end(take)
    t = b.atomic_rmw("add", shared, ir.Constant(I64, 1), "monotonic")
    b.cbranch(b.icmp_signed("<", t, total), body, done)
    b.position_at_end(body)
    yield t
    b.branch(take)
    b.position_at_end(done)


# Home ranges (claim_home_first): one counter per range, each on a cache line of its own;
# a launch of more tasks than this shares ranges between them.
HOME_RANGES = 64
_LINE = 8  # i64s per cache line


def home_counters(b: ir.IRBuilder) -> ir.Value:
    """Zeroed counters for :func:`claim_home_first` (a static stack array, a cache line
    per counter), as an i64 address."""
    with b.goto_block(b.function.entry_basic_block):
        slots = b.alloca(ir.ArrayType(I64, (HOME_RANGES + 1) * _LINE))
    start = b.and_(b.add(b.ptrtoint(slots, I64), I64(8 * _LINE - 1)), I64(-8 * _LINE))  # line-aligned
    zero_bytes(b, b.inttoptr(start, PTR), I64(HOME_RANGES * _LINE * 8))
    return start


def zero_bytes(b: ir.IRBuilder, ptr, nbytes) -> None:
    """``memset(ptr, 0, nbytes)`` (``llvm.memset``; ``nbytes`` an i64 value)."""
    memset = declare(b.module, "llvm.memset.p0.i64", ir.VoidType(), [PTR, I8, I64, I1])
    b.call(memset, [ptr, I8(0), nbytes, I1(0)])


def copy_bytes(b: ir.IRBuilder, dst, src, nbytes) -> None:
    """``memcpy(dst, src, nbytes)`` (``llvm.memcpy``; ``nbytes`` an i64 value)."""
    memcpy = declare(b.module, "llvm.memcpy.p0.p0.i64", ir.VoidType(), [PTR, PTR, I64, I1])
    b.call(memcpy, [dst, src, nbytes, I1(0)])


@contextmanager
def claim_home_first(b: ir.IRBuilder, team, counters, units, per_unit, name: str = "task"):
    """Every task ``t`` of ``units * per_unit`` (unit ``t // per_unit``), each once, on a
    :meth:`~jitbyoc.render.llvm.Ctx.parallel_for` over ``units`` (``team`` its task):
    the units split into ranges as the launch splits them among its tasks, and each
    task claims the tasks of its own range (:func:`claim_each`) before it moves on to
    the next ranges'. A task then works on the data its range's units own (the input rows
    it packed, the output rows it wrote the call before) unless another falls behind.
    ``counters`` from :func:`home_counters`."""
    ranges = smin(b, team.size, I64(HOME_RANGES))
    mine = b.srem(team.index, ranges)
    with for_range(b, ranges, f"{name}.range") as i:
        r = b.srem(b.add(mine, i), ranges)
        first = b.sdiv(b.mul(units, r), ranges)
        last = b.sdiv(b.mul(units, b.add(r, I64(1))), ranges)
        counter = b.add(counters, b.mul(r, I64(8 * _LINE)))
        with claim_each(b, counter, b.mul(b.sub(last, first), per_unit), name) as k:
            yield b.add(b.mul(first, per_unit), k)


# When work is worth TVM's thread pool, by kind: a static size below the bound runs on
# the calling thread; a symbolic size is compared with it when the kernel runs
# (:class:`AtRunTime`). One table for every stage.
THREAD_MIN = {
    "elementwise": 1 << 16,  # a fused elementwise nest (elements)
    "stage": 1 << 15,        # norms, reductions (elements of the input)
    "rows": 1 << 14,         # softmax rows, resize and ROI rows (elements of the output)
    # pooling planes (elements of the output): a pool of 4K outputs runs 9 or more taps
    # each; Inception v1's pools of a module's output parts (13x13 and 6x6 maps, 6-10K
    # outputs) ran on one thread while the other waited: bf16 model 0.978x with them on two
    "pool": 1 << 12,
    # pure copies are bound by memory bandwidth: on 2 cores a pool gains nothing below a
    # few MiB, and a launch costs more than a copy that fits in L2
    "copy": 1 << 18,
    "gemm": 1 << 17,         # multiply-adds of a product (static, or checked at run time)
}


@dataclass(frozen=True)
class AtRunTime:
    """Work of a symbolic size: the LLVM rendering launches the pool only when the size,
    known when the kernel runs, reaches :data:`THREAD_MIN` (a decoder's step of one
    token: the norms and attention stages of its regions ran 2-3 pool launches each);
    elsewhere (C, or a kernel that branches on it while rendering) it counts as worth the
    pool, as a symbolic size always did."""
    shape: tuple
    kind: str

    def __bool__(self) -> bool:
        return True

    def small(self, ctx) -> ir.Value:
        """i1: whether this run's size is below the bound (``ctx``: an LLVM Ctx)."""
        return ctx.b.icmp_signed("<", ctx.product(self.shape), I64(THREAD_MIN[self.kind]))


def threaded(shape, kind: str) -> bool | AtRunTime:
    """Whether work over ``shape`` (ints and symbolic names) is worth the thread pool:
    a bool when the size is static, else an :class:`AtRunTime`."""
    static = 1
    for d in shape:
        if isinstance(d, str):
            return AtRunTime(tuple(shape), kind)
        static *= d
    return static >= THREAD_MIN[kind]


def workspace(c, dtype: str, elements):
    """A buffer of ``elements`` of ``dtype`` (plus a vector of slack) from TVM's
    (per-thread) workspace pool; returns from the function on failure."""
    d = lookup_dtype(dtype)
    alloc = declare(c.module, "TVMBackendAllocWorkspace", PTR, [I32, I32, I64, I32, I32])
    nbytes = c.b.add(c.b.mul(elements, I64(d.nbytes)), I64(VECTOR_BYTES))
    ptr = c.b.call(alloc, [I32(1), I32(0), nbytes, I32(d.dl_code), I32(d.storage_bits)])
    with c.b.if_then(c.b.icmp_unsigned("==", c.b.ptrtoint(ptr, I64), I64(0)), likely=False):
        c.b.ret(I32(-1))  # TVM's allocator has set the error
    return ptr


def free_workspace(c, ptr) -> None:
    free = declare(c.module, "TVMBackendFreeWorkspace", I32, [I32, I32, PTR])
    c.b.call(free, [I32(1), I32(0), ptr])

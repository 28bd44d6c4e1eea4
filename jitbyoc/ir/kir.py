"""The kernel IR: buffers, elementwise expression DAGs, and the stages of a kernel.

A region becomes one :class:`Kernel`. Its stages run in order; an :class:`Elementwise`
stage is one loop nest over an output shape that evaluates an expression DAG per point
and stores every output of that shape, so fused ops never touch memory in between.
Dimensions are ``int`` or the name of a symbolic size read from the arguments at run time.
Nodes compare by identity: the lowering shares a node wherever Relax shares a value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Union

Dim = Union[int, str]


@dataclass(frozen=True)
class Buffer:
    """A row-major array. With ``base`` set it is a *view*: the same elements as ``base``
    (same count and order) under another shape, sharing its memory; renderers address
    ``base``, so a view is never allocated, passed or freed (see :func:`view`)."""
    name: str
    shape: tuple[Dim, ...]
    dtype: str
    base: "Buffer | None" = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def storage(self) -> "Buffer":
        """The buffer that owns the memory: ``base`` for a view, else itself."""
        return self if self.base is None else self.base


def without_leading_ones(shape) -> tuple:
    """``shape`` with its leading unit dims dropped: the shapes a reshape that only adds
    or drops leading unit dims maps onto each other (``(1, H, S, S)`` and ``(H, S, S)``)."""
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def view(buf: Buffer, shape) -> Buffer:
    """``buf`` reshaped without a copy (a view of its storage; views never nest)."""
    root = buf.storage
    if tuple(shape) == root.shape:
        return root
    return Buffer(f"{root.name}_view", tuple(shape), root.dtype, base=root)


@dataclass(frozen=True, eq=False)
class Load:
    """The element of ``buf`` at the current point, broadcast NumPy-style (right-aligned)."""
    buf: Buffer

    @property
    def dtype(self) -> str:
        return self.buf.dtype


@dataclass(frozen=True, eq=False)
class Const:
    value: Any
    dtype: str


@dataclass(frozen=True, eq=False)
class Op:
    """Row ``op`` of :data:`jitbyoc.ir.ops.OPS` applied to ``args`` (whose dtype is ``in_dtype``)."""
    op: str
    args: tuple
    in_dtype: str
    dtype: str
    attrs: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.attrs)


@dataclass(frozen=True, eq=False)
class Acc:
    """In a kernel's epilogue: the value the kernel computed at the current point."""
    dtype: str


@dataclass(frozen=True, eq=False)
class Lookup:
    """``table[index]``: the element of the 1-D buffer ``table`` at ``index`` (an integer
    node, in range: the builder clamps it). Unlike a :class:`Load`, its position is data,
    not the current point: the table is read whole wherever the node is evaluated."""
    table: Buffer
    index: Any
    # () or (byte, base): ``index`` is ``clamp(base + byte)`` with ``byte`` a uint8 widened
    # (0..255): where ``base`` is one value across a vector, a renderer may read the 256
    # entries from ``table[base]`` (a table of a byte per channel: :mod:`jitbyoc.tvm.channel_tables`)
    rows: tuple = ()

    @property
    def dtype(self) -> str:
        return self.table.dtype


Node = Union[Load, Const, Op, Acc, Lookup]


def operands(node) -> tuple:
    """The nodes ``node`` is computed from."""
    return node.args if isinstance(node, Op) else (node.index, *node.rows) if isinstance(node, Lookup) else ()


@dataclass(frozen=True)
class Elementwise:
    shape: tuple[Dim, ...]
    stores: tuple[tuple[Buffer, Node], ...]


@dataclass(eq=False)
class KernelStage:
    """A stage computed by a hand-written kernel (``jitbyoc/kernels/``) into ``out``.

    ``epilogue``, when set, is an elementwise expression over :class:`Acc` (and loads
    broadcast against ``out``) that the kernel applies to each block of ``out`` while the
    block is still in cache: ``out[p] = epilogue(Acc=out[p])``. With ``epilogue_out``
    (``out``'s shape, any dtype) the epilogue writes there instead, ``epilogue_out[p] =
    epilogue(Acc=out[p])``, and ``out`` is the kernel's scratch: an int8 product's int32
    sums requantized to uint8 block by block. ``epilogue_also`` (with ``epilogue_out``
    only) are more ``(buffer, expression)`` stores of the same blocks, each buffer of
    ``out``'s shape: a residual sum kept in float32 and cast to bfloat16 for the next
    product, both written while the block is in cache. Subclasses hold their operands and
    attributes and implement ``emit_llvm(ctx)``, ``emit_c(ctx)`` and ``reference(*arrays)``.
    """
    inputs: tuple
    out: Buffer
    epilogue: object = None
    epilogue_out: Buffer | None = None
    epilogue_also: tuple = ()
    # whether every emit path applies the epilogue through ``ctx.epilogue`` on finished
    # blocks only (then ``epilogue_out`` may be set): the products
    writes_epilogue_apart = False

    @property
    def result(self) -> Buffer:
        """The buffer the stage leaves its result in: ``epilogue_out`` or ``out``."""
        return self.out if self.epilogue_out is None else self.epilogue_out

    def epilogue_stores(self) -> list[tuple]:
        """``(buffer, expression)`` of every store the epilogue makes (none without one)."""
        if self.epilogue is None:
            return []
        return [(self.result, self.epilogue)] + list(self.epilogue_also)

    def reads(self) -> list[Buffer]:
        roots = [self.epilogue] + [e for _, e in self.epilogue_also] if self.epilogue is not None else []
        return list(self.inputs) + loads(roots) + tables(roots)

    def map_epilogue(self, fn) -> None:
        """Replace the epilogue's expressions (``epilogue`` and those of ``epilogue_also``)
        by ``fn(roots)``, a list of as many roots; nothing without an epilogue."""
        if self.epilogue is None:
            return
        views = [view for view, _ in self.epilogue_also]
        self.epilogue, *also = fn([self.epilogue] + [e for _, e in self.epilogue_also])
        self.epilogue_also = tuple(zip(views, also))

    def macs(self) -> tuple[Dim, ...] | None:
        """Multiply-adds this stage makes, as a product of dims (the profiler's FLOP count
        is twice it); None for stages that are not products (pools, norms, layout); a
        list of such products for a stage that fuses several (attention)."""
        return None

    def needs_loop_vectorizer(self) -> bool:
        """Whether ``emit_llvm`` leaves scalar loops for LLVM's loop vectorizer (the
        default), rather than writing its vectors itself (then its region may skip that
        pass; the epilogue decides for itself)."""
        return True


@dataclass
class Kernel:
    name: str
    inputs: list[Buffer]
    outputs: list[Buffer]
    stages: list = field(default_factory=list)
    temps: list[Buffer] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)  # Relax ops covered, for the report
    # derived sizes: name -> definition over the plain ones (jitbyoc.ir.sizes)
    sizes: dict[str, tuple] = field(default_factory=dict)
    # temps that are not allocated but live inside another buffer: temp -> (buffer, offset
    # in elements); a concatenation's parts made in the region (jitbyoc.kernels.concat_parts)
    placed: dict = field(default_factory=dict)

    @property
    def params(self) -> list[Buffer]:
        return self.inputs + self.outputs

    @property
    def plain_sizes(self) -> list[str]:
        """The symbolic sizes read from argument shapes, in order of first appearance."""
        seen: dict[str, None] = {}
        for b in self.params:
            for d in b.shape:
                if isinstance(d, str) and d not in self.sizes:
                    seen.setdefault(d)
        return list(seen)

    @property
    def sym_vars(self) -> list[str]:
        """Symbolic sizes: the plain ones, then the derived ones."""
        return self.plain_sizes + list(self.sizes)


def allocated_temps(kernel: Kernel) -> list[Buffer]:
    """The temps the kernel allocates (and frees): all but the placed ones."""
    return [t for t in kernel.temps if t not in kernel.placed]


def placed_in_order(kernel: Kernel) -> list[Buffer]:
    """The placed temps, each after the buffer it lives in (placements chain: a part of a
    concatenation that is itself placed in a region output)."""
    order, done = [], {b for b in kernel.params + kernel.temps if b not in kernel.placed}
    pending = list(kernel.placed)
    while pending:
        ready = [t for t in pending if kernel.placed[t][0] in done]
        if not ready:
            raise ValueError(f"jitbyoc: {kernel.name}: placements {[t.name for t in pending]} form a cycle")
        order += ready
        done.update(ready)
        pending = [t for t in pending if t not in done]
    return order


def describe(stage) -> str:
    """A stage as error messages name it: the ops of an elementwise nest; a kernel's class
    and the Relax binding it was lowered from (its ``origin``, set by the lowering and not
    part of the kernel's key: see :func:`canonical`)."""
    if isinstance(stage, Elementwise):
        ops = dict.fromkeys(n.op for n in walk([e for _, e in stage.stores]) if isinstance(n, Op))
        return f"elementwise stage ({', '.join(ops) or 'copy'})"
    origin = getattr(stage, "origin", None)
    return f"{type(stage).__name__} stage" + (f" of {origin}" if origin else "")


def walk(roots):
    """Nodes reachable from ``roots``, each once, operands before users."""
    order, seen = [], set()
    stack = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, done = stack.pop()
        if id(node) in seen:
            continue
        if done or not isinstance(node, (Op, Lookup)):
            seen.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(operands(node)) if id(a) not in seen)
    return order


def evaluate(em, roots, load, acc=None, lookup=None, row_lookup=None) -> dict:
    """Render every node reachable from ``roots`` once, operands first, through a
    renderer's emitter: ``load(buf)`` reads a Load's raw element, ``em.loaded(raw, dtype)``
    turns it into a value, ``acc`` stands for :class:`Acc`, ``lookup(table, index)`` reads
    a :class:`Lookup`'s raw element, ``row_lookup(table, index, byte, base)`` (optional)
    one with :attr:`Lookup.rows`. Returns ``{id(node): value}``. Both renderers walk
    expressions through this one function, so they line up."""
    values = {}
    for node in walk(roots):
        if isinstance(node, Load):
            values[id(node)] = em.loaded(load(node.buf), node.dtype)
        elif isinstance(node, Lookup):
            if lookup is None:
                raise TypeError("jitbyoc: a table lookup where this kernel cannot read one")
            index = values[id(node.index)]
            raw = row_lookup(node.table, index, *(values[id(r)] for r in node.rows)) \
                if node.rows and row_lookup is not None else lookup(node.table, index)
            values[id(node)] = em.loaded(raw, node.dtype)
        elif isinstance(node, Const):
            values[id(node)] = em.const(node.value, node.dtype)
        elif isinstance(node, Acc):
            values[id(node)] = acc
        else:
            values[id(node)] = em.op(node.op, node.in_dtype, *(values[id(a)] for a in node.args),
                                     **node.kwargs)
    return values


def stage_reads(stage) -> list[Buffer]:
    """Buffers ``stage`` reads, plus the storage behind any view among them."""
    roots = [n for _, n in stage.stores] if isinstance(stage, Elementwise) else None
    reads = loads(roots) + tables(roots) if roots is not None else stage.reads()
    return list(dict.fromkeys(reads + [b.base for b in reads if b.base is not None]))


def stage_writes(stage) -> list[Buffer]:
    if isinstance(stage, Elementwise):
        return [b for b, _ in stage.stores]
    if stage.epilogue_out is None:
        return [stage.out]
    return [stage.out, stage.epilogue_out] + [buf for buf, _ in stage.epilogue_also]


def substitute(root, mapping):
    """``root`` with every node in ``mapping`` (by identity) replaced; shares the rest."""
    return substitute_all([root], mapping)[0]


def substitute_all(roots, mapping) -> list:
    """:func:`substitute` on several roots at once: a node they share stays one node."""
    return _rebuilt(roots, {id(k): v for k, v in mapping.items()}, {})


def renamed(roots, names: dict) -> list:
    """``roots`` with every :class:`Op` whose op is a key of ``names`` made that value's
    op (the same operands, dtypes and attributes); shared nodes stay shared."""
    return _rebuilt(roots, {}, names)


def _rebuilt(roots, memo: dict, names: dict) -> list:
    """``roots`` with the nodes ``memo`` maps (by id) replaced, the ops ``names`` maps
    renamed, and every node above them rebuilt."""
    for node in walk(roots):
        if id(node) in memo:
            continue
        if isinstance(node, Op):
            args = tuple(memo.get(id(a), a) for a in node.args)
            if node.op in names or any(x is not y for x, y in zip(args, node.args)):
                memo[id(node)] = Op(names.get(node.op, node.op), args, node.in_dtype, node.dtype, node.attrs)
        elif isinstance(node, Lookup) and any(id(a) in memo for a in operands(node)):
            index, *rows = (memo.get(id(a), a) for a in operands(node))
            memo[id(node)] = Lookup(node.table, index, tuple(rows))
    return [memo.get(id(root), root) for root in roots]


def loads(roots) -> list[Buffer]:
    """The buffers ``roots`` read at the current point (broadcast), each once."""
    out: dict[Buffer, None] = {}
    for n in walk(roots):
        if isinstance(n, Load):
            out.setdefault(n.buf)
    return list(out)


def tables(roots) -> list[Buffer]:
    """The buffers ``roots`` look elements up in (:class:`Lookup`), each once: read
    whole, not walked by the loop around them."""
    return list(dict.fromkeys(n.table for n in walk(roots) if isinstance(n, Lookup)))


@dataclass(frozen=True)
class NestLayout:
    """A loop nest after dropping unit dims and merging dims every buffer walks alike.

    ``extents[k]`` is a product of dims; ``strides[buf][k]`` the product of dims to step
    ``buf`` by per step of loop ``k`` (``None``: the buffer is broadcast along it).
    """
    extents: tuple[tuple[Dim, ...], ...]
    strides: dict


def nest_layout(shape: tuple[Dim, ...], bufs) -> NestLayout:
    nd = len(shape)
    keep = [k for k in range(nd) if shape[k] != 1]

    def walks(b: Buffer, k: int) -> bool:
        j = k - (nd - b.ndim)
        return j >= 0 and b.shape[j] != 1

    groups: list[list[int]] = []
    for k in keep:
        if groups and all(walks(b, groups[-1][-1]) == walks(b, k) for b in bufs):
            groups[-1].append(k)
        else:
            groups.append([k])
    extents = tuple(tuple(shape[k] for k in g) for g in groups)
    strides = {}
    for b in bufs:
        off = nd - b.ndim
        strides[b] = tuple(
            tuple(d for d in b.shape[g[-1] - off + 1:] if d != 1) if walks(b, g[-1]) else None
            for g in groups)
    return NestLayout(extents, strides)


def canonical(kernel: Kernel) -> str:
    """A text that determines ``kernel``'s code: every field of every buffer, stage and
    node, shared nodes written once and referred to by number, the kernel's own name left
    out. Two kernels with the same text render the same code (the renderers read nothing
    else), so the text, with jitbyoc's and the target's versions, is the compile key.
    Raises TypeError on a value it cannot write faithfully, never guesses."""
    ids: dict[int, int] = {}
    defs: list[str] = []

    def node(n) -> str:
        for m in walk([n]):  # operands first, iteratively: expression DAGs can be deep
            if id(m) not in ids:
                body = f"Op({m.op!r},({','.join(f'#{ids[id(a)]}' for a in m.args)}),{m.in_dtype!r}," \
                       f"{m.dtype!r},{value(m.attrs)})" if isinstance(m, Op) else record(m)
                ids[id(m)] = len(defs)
                defs.append(body)
        return f"#{ids[id(n)]}"

    def record(x) -> str:
        return type(x).__qualname__ + "(" + ",".join(
            f"{f.name}={value(getattr(x, f.name))}" for f in fields(x)) + ")"

    def value(x) -> str:
        if x is None or isinstance(x, (bool, int, str)):
            return repr(x)
        if isinstance(x, float):
            return x.hex()
        if isinstance(x, (Load, Const, Op, Acc, Lookup)):
            return node(x)
        if isinstance(x, (tuple, list)):
            return ("[" if isinstance(x, list) else "(") + ",".join(map(value, x)) + ")"
        if isinstance(x, dict):
            return "{" + ",".join(f"{value(k)}:{value(v)}" for k, v in x.items()) + "}"
        if is_dataclass(x) and not isinstance(x, type):
            return record(x)
        if hasattr(x, "dtype") and hasattr(x, "item"):  # a numpy scalar
            return f"{x.dtype}:{value(x.item())}"
        raise TypeError(f"jitbyoc: cannot key a kernel holding a {type(x).__name__} ({x!r:.80})")

    top = record(replace(kernel, name=""))
    return "\n".join(defs + [top])

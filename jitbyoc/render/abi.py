"""The packed-function entry, as a renderer-neutral list of argument checks.

TVM calls ``int32 __tvm_ffi_<symbol>(void* self, const TVMFFIAny* args, int32 n, TVMFFIAny* ret)``
with the region's inputs then its preallocated outputs. Each argument is a 16-byte
``TVMFFIAny``: ``int32 type_index`` at 0, the value at 8. A ``tvm.runtime.Tensor``
(type index 70) holds its ``DLTensor`` 24 bytes after the object pointer; a raw
``DLTensor*`` has type index 7. The entry checks every argument and, on a mismatch, sets
a TVM error naming the region, the argument and expected vs got, then returns -1.

Each check renders itself, once per renderer: ``emit_c(entry)`` writes its C statements
(:class:`jitbyoc.toolchain.c_entry.Entry`), ``record(slot)`` encodes it as a record of the
table that the shared argument engine walks in LLVM (:mod:`jitbyoc.engines.args`, whose
op codes are defined here). So the C and LLVM entries enforce the same contract with the
same messages. The plan depends on the kernel alone; the user's names come in as data,
through the names table of :func:`strings`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.dtypes import dtype as lookup_dtype
from ..ir import sizes
from ..ir.kir import Kernel
from .indexing import CInts

ANY_SIZE = 16
TYPE_DLTENSOR_PTR = 7
TYPE_TENSOR = 70
TENSOR_DLTENSOR_OFFSET = 24
KDL_CPU = 1
# DLTensor field offsets (x86-64 / aarch64 layout)
DL_DATA, DL_DEVICE_TYPE, DL_NDIM, DL_DTYPE, DL_SHAPE, DL_STRIDES, DL_BYTE_OFFSET = 0, 8, 16, 20, 24, 32, 40


# Messages. A check's ``message`` is a printf format written by jitbyoc alone: the user's
# names (arguments, symbolic sizes) never enter it. They reach it as ``%s`` arguments,
# strings of the region's *names table* (:func:`strings`), made per use of the code:
# ``strings[k]`` for each index ``k`` of a check's ``strings``. Each kind of check passes
# its values in one fixed order, the same in both renderers (the format follows it):
#   ArgCount  %s nargs               Unpack  %s type_index
#   FieldEq   %s part0 part1 part2   DimEq   %s %s got [%s bound]   Contiguous  %s axis got want
REGION, ARG, SHAPE, SIZE = "region", "arg", "shape", "size"
# Record op codes of the argument engine's table (see jitbyoc.engines.args).
COUNT, UNPACK, FIELD, DIM, BIND, DIM_SYM, CONTIG, DATA = range(8)


@dataclass(frozen=True)
class ArgCount:
    expected: int
    message: str  # %s region, %d got
    strings: tuple = ()

    def record(self, slot: dict) -> tuple:
        return (COUNT, 0, 0, self.expected, self.message, 0)

    def emit_c(self, e) -> None:
        e.fail_if(f"num_args != {self.expected}", self, e.string(self, 0), "num_args")


@dataclass(frozen=True)
class Unpack:
    """Resolve argument ``index`` to its DLTensor; anything else is a type error."""
    index: int
    message: str  # %s argument, %d got type index
    strings: tuple = ()

    def record(self, slot: dict) -> tuple:
        return (UNPACK, self.index, 0, 0, self.message, 0)

    def emit_c(self, e) -> None:
        i = self.index
        e.line(f"const int32_t ti{i} = args[{i}].type_index;")
        e.fail_if(f"ti{i} != {TYPE_TENSOR} && ti{i} != {TYPE_DLTENSOR_PTR}", self, e.string(self, 0), f"ti{i}")
        e.line(f"const char* dl{i} = (const char*)args[{i}].v.v_ptr + "
               f"(ti{i} == {TYPE_TENSOR} ? {TENSOR_DLTENSOR_OFFSET} : 0);")


@dataclass(frozen=True)
class FieldEq:
    """The int field at ``offset`` of the DLTensor (``bits`` wide) equals ``expected``."""
    index: int
    offset: int
    bits: int
    expected: int
    message: str  # %s argument, then one %d per entry of ``parts``
    parts: tuple = ((0, -1),)  # (shift, mask) of the got value to print; -1: all of it
    strings: tuple = ()

    def record(self, slot: dict) -> tuple:
        assert self.bits == 32 and len(self.parts) <= 3
        show = 0
        for p, (shift, mask) in enumerate(self.parts):
            width = 32 if mask < 0 else mask.bit_length()
            assert mask < 0 or mask == (1 << width) - 1
            show |= (shift | width << 8) << 16 * p
        return (FIELD, self.index, self.offset, self.expected, self.message, show)

    def emit_c(self, e) -> None:
        got = f"jb_i32_at(dl{self.index}, {self.offset})"
        shown = [got if mask < 0 else f"(int)(((uint32_t){got} >> {shift}) & {mask})"
                 for shift, mask in self.parts]
        e.fail_if(f"{got} != {self.expected}", self, e.string(self, 0), *shown)


@dataclass(frozen=True)
class DimEq:
    """``shape[axis]`` equals an int, or binds/checks a symbolic size."""
    index: int
    axis: int
    expected: int | str
    binds: bool  # first sight of a symbolic size: bind it instead of checking
    message: str  # %s argument, %s shape, %lld got (then %s size, %lld bound: symbolic)
    strings: tuple = ()

    def record(self, slot: dict) -> tuple:
        symbolic = isinstance(self.expected, str)
        op = BIND if self.binds else DIM_SYM if symbolic else DIM
        return (op, self.index, self.axis, slot[self.expected] if symbolic else self.expected,
                self.message, 0)

    def emit_c(self, e) -> None:
        got = f"((const int64_t*)jb_ptr_at(dl{self.index}, {DL_SHAPE}))[{self.axis}]"
        if self.binds:
            e.line(f"const int64_t {self.expected} = {got};")
            return
        shown = [e.string(self, 0), e.string(self, 1), f"(long long){got}"]
        if isinstance(self.expected, str):
            shown += [e.string(self, 2), f"(long long){self.expected}"]
        e.fail_if(f"{got} != {self.expected}", self, *shown)


@dataclass(frozen=True)
class Contiguous:
    """Null strides, or compact row-major strides (unit dims excepted)."""
    index: int
    message: str  # %s argument, %d axis, %lld got, %lld expected
    strings: tuple = ()
    shape: tuple = ()  # the buffer's

    def record(self, slot: dict) -> tuple:
        return (CONTIG, self.index, len(self.shape), 0, self.message, 0)

    def emit_c(self, e) -> None:
        i, ints = self.index, CInts()
        if all(d == 1 for d in self.shape):  # a scalar or all-unit shape: nothing to check
            return
        e.line(f"const int64_t* st{i} = (const int64_t*)jb_ptr_at(dl{i}, {DL_STRIDES});")
        for axis, d in enumerate(self.shape):
            if d == 1:
                continue
            want = ints.i(ints.product(self.shape[axis + 1:]))
            cond = f"st{i} && st{i}[{axis}] != {want}" + (f" && {d} != 1" if isinstance(d, str) else "")
            e.fail_if(cond, self, e.string(self, 0), str(axis), f"(long long)st{i}[{axis}]", f"(long long)({want})")


def _dtype_word(name: str) -> int:
    dt = lookup_dtype(name)
    return dt.dl_code | (dt.storage_bits << 8) | (1 << 16)


def string_index(kernel: Kernel, kind: str, k: int = 0) -> int:
    """Where a string sits in the names table: the region, then per parameter its
    description and its shape, then per symbolic size its user's name."""
    nparams = len(kernel.params)
    return {REGION: 0, ARG: 1 + k, SHAPE: 1 + nparams + k, SIZE: 1 + 2 * nparams + k}[kind]


@dataclass(frozen=True)
class Derive:
    """A derived size (:mod:`jitbyoc.ir.sizes`), computed from the plain sizes bound before
    it; the dim checks after it compare shapes with it like with any size. Not a record of
    the argument engine's table: the LLVM entry computes it between two table walks."""
    name: str
    tree: tuple
    strings: tuple = ()

    def emit_c(self, e) -> None:
        e.line(f"const int64_t {self.name} = {sizes.emit_c(self.tree)};")


def plan(kernel: Kernel) -> list:
    """The entry's checks, in order. Nothing in them depends on the user's names. With
    derived sizes, every argument is read and every plain size bound first, then the
    derived sizes are computed, then the dims are checked."""
    n_in, n_out = len(kernel.inputs), len(kernel.outputs)
    count = ArgCount(len(kernel.params), f"%s: expected {len(kernel.params)} arguments "
                     f"({n_in} inputs, {n_out} outputs), got %d", (string_index(kernel, REGION),))
    bound: set[str] = set()
    heads, tails = [], []
    for i, buf in enumerate(kernel.params):
        head, tail = _argument_checks(kernel, i, buf, bound)
        heads.append(head)
        tails.append(tail)
    if not kernel.sizes:
        return [count] + [c for head, tail in zip(heads, tails) for c in head + tail]
    derive = [Derive(name, tree) for name, tree in kernel.sizes.items()]
    return [count] + [c for head in heads for c in head] + derive + [c for tail in tails for c in tail]


def _argument_checks(kernel: Kernel, i: int, buf, bound: set) -> tuple[list, list]:
    """Argument ``i``'s checks: those that read it and bind its plain sizes, then those
    that check its dims and strides (in this order when there are no derived sizes)."""
    arg = (string_index(kernel, ARG, i),)
    head: list = [Unpack(i, "%s: expected a tvm.runtime.Tensor or DLTensor, got FFI type index %d", arg),
                  FieldEq(i, DL_DEVICE_TYPE, 32, KDL_CPU,
                          f"%s: expected a CPU tensor (device type {KDL_CPU}), got device type %d", strings=arg),
                  FieldEq(i, DL_NDIM, 32, buf.ndim, f"%s: expected ndim {buf.ndim}, got %d", strings=arg)]
    d = lookup_dtype(buf.dtype)
    head.append(FieldEq(i, DL_DTYPE, 32, _dtype_word(buf.dtype),
                        f"%s: expected dtype {buf.dtype} (DLDataType code {d.dl_code}, "
                        f"bits {d.storage_bits}, lanes 1), got code %d, bits %d, lanes %d",
                        ((0, 0xFF), (8, 0xFF), (16, 0xFFFF)), arg))
    shape = arg + (string_index(kernel, SHAPE, i),)
    checks: list = []
    for axis, d in enumerate(buf.shape):
        if isinstance(d, str) and d not in bound and d not in kernel.sizes:
            bound.add(d)
            (head if kernel.sizes else checks).append(DimEq(i, axis, d, True, ""))
        elif isinstance(d, str):
            checks.append(DimEq(i, axis, d, False, f"%s: expected shape %s, but shape[{axis}] is %lld "
                                f"(expected %s = %lld)",
                                shape + (string_index(kernel, SIZE, kernel.sym_vars.index(d)),)))
        else:
            checks.append(DimEq(i, axis, d, False, f"%s: expected shape %s, but shape[{axis}] is %lld "
                                f"(expected {d})", shape))
    checks.append(Contiguous(i, "%s: expected a contiguous tensor, but strides[%d] is %lld "
                                "(expected %lld)", arg, buf.shape))
    return (head, checks) if kernel.sizes else (head + checks, [])


def _shown(text: str, limit: int = 200) -> str:
    """The user's text as it appears in a message: non-printable characters escaped
    (a NUL would end the message), long names cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def strings(kernel: Kernel, symbol: str, arg_names, size_names: dict[str, str]) -> list[str]:
    """The names table of one use of ``kernel`` (see :func:`string_index`)."""
    roles = [f"input {i}" for i in range(len(kernel.inputs))] + \
            [f"output {i}" for i in range(len(kernel.outputs))]
    where = f"jitbyoc region '{symbol}'"
    out = [where]
    out += [f"{where}: argument {i} ('{_shown(name)}', {role})"
            for i, (name, role) in enumerate(zip(arg_names, roles))]
    for buf in kernel.params:
        dims = [_shown(size_names.get(d, d)) if isinstance(d, str) else str(d) for d in buf.shape]
        out.append("(" + ", ".join(dims) + ("," if buf.ndim == 1 else "") + ")")
    out += [_shown(size_names.get(s, s)) for s in kernel.sym_vars]
    return out


def ir_bytes(data: bytes) -> str:
    """``data`` as an LLVM IR string constant body: printable ASCII but quote and
    backslash as is, every other byte as ``\\XX``."""
    return "".join(chr(c) if 0x20 <= c < 0x7F and c not in (0x22, 0x5C) else f"\\{c:02X}" for c in data)


def c_string(name: str, text: str) -> str:
    """A private, NUL-terminated LLVM IR byte-string constant ``@name`` holding ``text``."""
    data = text.encode() + b"\0"
    return f'@{name} = private unnamed_addr constant [{len(data)} x i8] c"{ir_bytes(data)}"'


def names_table(texts: list[str]) -> tuple[list[int], bytes]:
    """``texts`` as a relocation-free table: one i64 byte offset per string (from the
    table's start), then the NUL-terminated UTF-8 strings."""
    blob, offsets = bytearray(), []
    start = 8 * len(texts)
    for t in texts:
        offsets.append(start + len(blob))
        blob += t.encode("utf-8", "backslashreplace").replace(b"\0", b"\\0") + b"\0"
    return offsets, bytes(blob)

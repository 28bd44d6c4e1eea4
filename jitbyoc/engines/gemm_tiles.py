"""The GEMM engine's tile microkernel: AMX (Sapphire Rapids and later Xeons), where the
machine has it for the product, beside the vector microkernels of :mod:`.gemm_micro`.

AMX holds eight *tiles* of 16 rows x 64 bytes and multiplies them in one instruction:
``tdpbusd`` / ``tdpbsud`` sum int8 quads into 16x16 int32 (16x16x64 multiply-adds),
``tdpbf16ps`` bfloat16 pairs into 16x16 float32. The right operand is read in units of
``group`` k interleaved across its 16 columns, which is the layout the engine's B panels
have already (:class:`.gemm.Panels`, :mod:`.gemm_units`); the left operand is 16 rows of
64 bytes of k, which is A where it lies when A's rows hold whole units
(:func:`.gemm_llvm.a_in_place`). So the tile kernel changes no packing: it reads what the
vector kernels read.

The register tile is ``32 x 32``: four accumulator tiles, two tiles of A (rows 0-15,
16-31) and two of B (columns 0-15, 16-31) per 16 units of k, and one more step for the
last ``kc mod 16`` units from zero-padded copies; edges reach it through scratch tiles
(:mod:`.gemm_tiled`), an edge of at most 16 rows or columns on a kernel of one row or
column of tiles (:class:`Tiles`' ``rows``, ``cols``). A reduction under one step runs on
the vector kernel in strips of :data:`STRIP_ROWS` rows, adding into the same C. Integer
sums are exact, so the split changes no int8 result; a bfloat16 sum is summed in another
order (documented with the bf16 mode).

The tile configuration (``ldtilecfg``, 64 bytes) is loaded by each task of a product
before its first tile kernel call and released at its end (``tilerelease``): between the
two only jitbyoc's code runs on the thread (vector kernels and epilogues, which leave the
tiles alone), and nothing is assumed of the state another library leaves.

Linux hands AMX's 8 KB of register state to a process only when it asks
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``): every module's CPU check asks
(:mod:`jitbyoc.toolchain.cpu_check`), so an exported library asks too.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

from llvmlite import ir

from ..ir.llvmtypes import I1, I8, I32, I64, PTR
from ..render import isa
from ..render.loops import for_range
from . import registry
from .gemm_micro import GEMM_PIPELINE, gep
from .products import PRODUCTS

TILE_ROWS, TILE_BYTES = 16, 64  # one tile: 16 rows of 64 bytes (16 units of k)
UNIT_BYTES = 4  # one unit (and one accumulator element)
TILE_UNITS = TILE_ROWS * TILE_BYTES // UNIT_BYTES  # units of one tile (1 KB)
STRIP_ROWS = 6  # rows per vector-kernel strip at edges: its 6 x NR register block
# the tile instruction of each product, and the machine features it needs
INSTRUCTIONS = {"uint8": ("llvm.x86.tdpbusd", "amx-int8"),  # unsigned A (activations) x signed B
                "int8": ("llvm.x86.tdpbsud", "amx-int8"),  # signed A (a conv's weight) x unsigned B
                "bfloat16": ("llvm.x86.tdpbf16ps", "amx-bf16")}
C_TILES, A_TILES, B_TILES = (0, 1, 2, 3), (4, 5), (6, 7)  # tile numbers: C[row tile][col tile] = 2*i + j
# Linux grants AMX's tile data to a process that asks: arch_prctl(ARCH_REQ_XCOMP_PERM,
# XFEATURE_XTILEDATA), through syscall(2) (the CPU check's call, and granted()'s); asking
# again is harmless
ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def has_tiles(dtype: str, machine: isa.Machine | None = None) -> bool:
    """Whether the product ``dtype`` runs on AMX tiles on ``machine`` (the build's by
    default): x86-64 Linux (which grants the tile state on request) with AMX-TILE and the
    product's tile instruction."""
    machine = machine or isa.current()
    found = INSTRUCTIONS.get(dtype)
    return (found is not None and machine.arch == "x86_64" and "linux" in machine.triple
            and machine.has("amx-tile") and machine.has(found[1]))


TILE_TYPE = ir.FunctionType(ir.VoidType(), [PTR, I64, PTR, I64, I64, PTR, PTR, PTR, I64, I1])


@registry.kind
@dataclass(frozen=True)
class Tiles(registry.Engine):
    """``tiles(a, axs, b, bks, steps, a_tail, b_tail, c, ldc, accumulate)``: the ``32 x 32``
    tile ``C (+)= A B`` over ``steps`` blocks of 16 units of k, tiles configured by the
    caller (:func:`configure`). ``A[i, u]`` (units) is at ``a + i*axs + u``, ``B[u, j]`` at
    ``b + u*bks + j`` (a panel of ``bks`` columns), C (the product's accumulator dtype) at
    ``c + i*ldc + j``; all three strides in elements. Unless ``a_tail`` is null, one more
    block follows from ``a_tail`` (32 rows of 16 units) and ``b_tail`` (16 rows of 32), C
    still in the tiles: k's last units, zero-padded by the caller. ``rows`` and ``cols``
    (1 or 2) are the tiles of 16 it computes along each side: an edge of at most 16 rows
    or columns takes half the tile products (a tile product costs the same whatever part
    of its 16 x 16 is wanted: ViT's 197 tokens end in a 5-row edge)."""
    kind = "tiles"
    pipeline = GEMM_PIPELINE
    dtype: str
    rows: int = 2
    cols: int = 2

    def signature(self) -> ir.FunctionType:
        return TILE_TYPE

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        _tile_body(module, fn, self.dtype, self.rows, self.cols)


def tile_kernel(module: ir.Module, dtype: str, rows: int = 2, cols: int = 2) -> ir.Function:
    return registry.use(module, Tiles(dtype, rows, cols))


def tap_tile_kernel(module: ir.Module, dtype: str, rows: int = 2, cols: int = 2) -> ir.Function:
    return registry.use(module, TapTiles(dtype, rows, cols))


def _config(module: ir.Module) -> ir.GlobalVariable:
    """The 64-byte tile configuration: palette 1, all eight tiles 16 rows of 64 bytes."""
    name = f"{module.name}_tile_config"
    if name in module.globals:
        return module.globals[name]
    data = bytearray(64)
    data[0] = 1
    for t in range(8):
        data[16 + 2 * t] = TILE_BYTES
        data[48 + t] = TILE_ROWS
    config = ir.GlobalVariable(module, ir.ArrayType(I8, 64), name)
    config.initializer = ir.Constant(ir.ArrayType(I8, 64), bytearray(data))
    config.global_constant, config.linkage, config.align = True, "internal", 64
    return config


def _intrinsic(module: ir.Module, name: str, args: list) -> ir.Function:
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)


def _tile_body(module: ir.Module, fn: ir.Function, dtype: str, rows: int, cols: int) -> None:
    a, axs, bp, bks, steps, a_tail, b_tail, c, ldc, accumulate = fn.args
    for p in (a, bp, a_tail, b_tail, c):
        p.add_attribute("noalias")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    k = _Kernel(module, b, dtype, rows, cols, c, ldc)
    with b.if_else(accumulate) as (then, otherwise):
        with then:
            k.load_c()
        with otherwise:
            k.zero_c()
    # A in place: row tile i from row 16 i, each block 16 units on along its rows
    tiles = [gep(b, a, b.mul(I64(TILE_ROWS * i), axs), k.unit) for i in range(rows)]
    k.steps(tiles, b.mul(axs, I64(UNIT_BYTES)), I64(TILE_BYTES // UNIT_BYTES), bp, bks, steps)
    with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(a_tail, I64), I64(0))):
        k.step([gep(b, a_tail, I64(i * TILE_ROWS * 16), k.unit) for i in range(rows)], I64(TILE_BYTES),
               b_tail, I64(2 * TILE_BYTES))
    k.store_c()
    b.ret_void()


class _Kernel:
    """A tile kernel's body on ``rows x cols`` tiles of C (at ``c``, ``ldc`` elements a
    row): C's tiles loaded, zeroed or stored, and steps of 16 units of k."""

    def __init__(self, module, b, dtype: str, rows: int, cols: int, c, ldc):
        self.b, self.rows, self.cols = b, rows, cols
        self.unit, acc = PRODUCTS[dtype].unit, PRODUCTS[dtype].acc
        self.load = _intrinsic(module, "llvm.x86.tileloadd64", [I8, PTR, I64])
        self.store = _intrinsic(module, "llvm.x86.tilestored64", [I8, PTR, I64])
        self.zero = _intrinsic(module, "llvm.x86.tilezero", [I8])
        self.multiply = _intrinsic(module, INSTRUCTIONS[dtype][0], [I8, I8, I8])
        self.used = [t for t in C_TILES if t // 2 < rows and t % 2 < cols]
        self.c_stride = b.mul(ldc, I64(UNIT_BYTES))
        self.c_at = {t: gep(b, c, b.add(b.mul(I64(TILE_ROWS * (t // 2)), ldc), I64(16 * (t % 2))), acc)
                     for t in self.used}

    def load_c(self) -> None:
        for t in self.used:
            self.b.call(self.load, [I8(t), self.c_at[t], self.c_stride])

    def zero_c(self) -> None:
        for t in self.used:
            self.b.call(self.zero, [I8(t)])

    def store_c(self) -> None:
        for t in self.used:
            self.b.call(self.store, [I8(t), self.c_at[t], self.c_stride])

    def _load_a(self, i, at, a_ld) -> None:
        self.b.call(self.load, [I8(A_TILES[i]), at, a_ld])

    def _load_b(self, j, b_row, b_ld) -> None:
        self.b.call(self.load, [I8(B_TILES[j]), gep(self.b, b_row, I64(16 * j), self.unit), b_ld])

    def _loads(self, a_rows, a_ld, b_row, b_ld) -> None:
        for i in range(self.rows):
            self._load_a(i, a_rows[i], a_ld)
        for j in range(self.cols):
            self._load_b(j, b_row, b_ld)

    def _product(self, t) -> None:
        self.b.call(self.multiply, [I8(t), I8(A_TILES[t // 2]), I8(B_TILES[t % 2])])

    def step(self, a_rows, a_ld, b_row, b_ld) -> None:
        """One block of 16 units: A's tiles at ``a_rows`` (``a_ld`` bytes a row), B's at
        ``b_row`` and 16 columns on (``b_ld`` bytes a row), multiplied into C's."""
        self._loads(a_rows, a_ld, b_row, b_ld)
        for t in self.used:
            self._product(t)

    def steps(self, tiles: list, a_ld, a_step, bp, bks, count) -> None:
        """``count`` blocks of 16 units: A's row tile ``i`` of block ``s`` at ``tiles[i] +
        s*a_step`` (units; ``a_ld`` bytes a row), ``B[u, j]`` at ``bp + u*bks + j``.
        Software-pipelined: each operand tile of the next block is loaded right after the
        last product of this block that reads it, under the products still to run. Tiles
        are not renamed (a load waits for the products reading its register), so loading
        all four before the products left the tile unit idle through each load: bf16
        128x768x3072 alone 335 -> 312 us, 197 rows 521 -> 485; BERT-base bf16 0.94-0.97x,
        ViT-base 0.92-0.97x, ResNet-50 0.93-1.02x the time (the AMX Xeon, alternating)."""
        b, unit = self.b, self.unit
        b_ld = b.mul(bks, I64(UNIT_BYTES))

        def operands(s):
            k0 = b.mul(s, I64(TILE_BYTES // UNIT_BYTES))
            return [gep(b, t, b.mul(s, a_step), unit) for t in tiles], gep(b, bp, b.mul(k0, bks), unit)

        last_a = {t // 2: t for t in self.used}  # the last product reading each operand
        last_b = {t % 2: t for t in self.used}
        with b.if_then(b.icmp_signed(">", count, I64(0))):
            a_rows, b_row = operands(I64(0))
            self._loads(a_rows, a_ld, b_row, b_ld)
            with for_range(b, b.sub(count, I64(1)), "ts") as s:
                a_next, b_next = operands(b.add(s, I64(1)))
                for t in self.used:
                    self._product(t)
                    if last_a[t // 2] == t:
                        self._load_a(t // 2, a_next[t // 2], a_ld)
                    if last_b[t % 2] == t:
                        self._load_b(t % 2, b_next, b_ld)
            for t in self.used:  # the last block's products
                self._product(t)


TAP_TILE_TYPE = ir.FunctionType(ir.VoidType(), [PTR, I64, I64, PTR, I64, I64, I64, PTR, PTR, I64])


@registry.kind
@dataclass(frozen=True)
class TapTiles(Tiles):
    """``taptiles(a, a_rows, a_tap, b, bks, steps, taps, offsets, c, ldc)``: the ``32 x
    32`` tile ``C = sum over taps t of A_t B_t``, each over ``steps`` blocks of 16 units
    of k, C in the tiles throughout and stored once (tiles configured by the caller): a
    direct convolution's window (:mod:`.conv_tiles`). A is packed tile by tile: row tile
    ``i`` of block ``s`` of tap ``t`` is the 1 KB (16 rows of 16 units) at ``a + i*a_rows
    + t*a_tap + s*256``; ``B_t[u, j]`` is at ``b + offsets[t] + u*bks + j`` (the packed
    input at the tap's shift; ``offsets``: i64), C at ``c + i*ldc + j``; strides in
    elements. ``rows`` and ``cols`` as for :class:`Tiles`."""
    kind = "taptiles"

    def signature(self) -> ir.FunctionType:
        return TAP_TILE_TYPE

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        a, a_rows, a_tap, bp, bks, steps, taps, offsets, c, ldc = fn.args
        for p in (a, bp, c):
            p.add_attribute("noalias")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        k = _Kernel(module, b, self.dtype, self.rows, self.cols, c, ldc)
        k.zero_c()
        with for_range(b, taps, "tap") as t:
            shift = b.load(b.gep(offsets, [t], source_etype=I64), typ=I64)
            first = b.mul(t, a_tap)
            tiles = [gep(b, a, b.add(first, b.mul(I64(i), a_rows)), k.unit) for i in range(self.rows)]
            k.steps(tiles, I64(TILE_BYTES), I64(TILE_UNITS), gep(b, bp, shift, k.unit), bks, steps)  # packed
        k.store_c()
        b.ret_void()


def configure(b: ir.IRBuilder) -> None:
    """Load the tile configuration (``ldtilecfg``): once per task of a product, before its
    first tile kernel call. Per call it cost 14 % of a call of 9 steps (58 ns)."""
    b.call(_intrinsic(b.module, "llvm.x86.ldtilecfg", [PTR]), [_config(b.module)])


def release(b: ir.IRBuilder) -> None:
    """Return the tiles to their initial state (``tilerelease``) at the end of a task."""
    b.call(_intrinsic(b.module, "llvm.x86.tilerelease", []), [])


@lru_cache(maxsize=1)
def granted() -> bool:
    """Ask Linux for the tile state for this process (what every module's CPU check does
    before a region runs), for code called without one: the peak loop. True when granted."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def loop_ir(dtype: str, triple: str) -> str:
    """``float dot(int64 n)``: n iterations of four tile products (C tiles 0-3 from A
    tiles 4-5 and B tiles 6-7, all zeros): the tile units' peak, the yardstick of the
    tile kernel as the ``vpdpbusd`` loop is of the vector one (:mod:`jitbyoc.peak`)."""
    module = ir.Module(name="tileloop")
    module.triple = triple
    fn = ir.Function(module, ir.FunctionType(ir.FloatType(), [I64]), "dot")
    zeros = ir.GlobalVariable(module, ir.ArrayType(I8, 1024), "tile_zeros")
    zeros.initializer, zeros.align = ir.Constant(ir.ArrayType(I8, 1024), bytearray(1024)), 64
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    load = _intrinsic(module, "llvm.x86.tileloadd64", [I8, PTR, I64])
    multiply = _intrinsic(module, INSTRUCTIONS[dtype][0], [I8, I8, I8])
    configure(b)
    for t in C_TILES + A_TILES + B_TILES:
        b.call(load, [I8(t), zeros, I64(TILE_BYTES)])
    with for_range(b, fn.args[0], "i"):
        for t in C_TILES:
            b.call(multiply, [I8(t), I8(A_TILES[t // 2]), I8(B_TILES[t % 2])])
    out = b.alloca(ir.ArrayType(I32, TILE_ROWS * 16))
    out.align = 64
    b.call(_intrinsic(module, "llvm.x86.tilestored64", [I8, PTR, I64]), [I8(0), out, I64(TILE_BYTES)])
    release(b)
    first = b.load(b.gep(out, [I32(0), I32(0)]))
    b.ret(b.sitofp(first, ir.FloatType()))  # an int32 or float32 tile: its bits as a number suffice
    return str(module)


def loop_flops(dtype: str) -> int:
    """FLOPs of one iteration of :func:`loop_ir`: four 16 x 16 tiles of 64 bytes of k."""
    return 4 * 2 * TILE_ROWS * 16 * (TILE_BYTES // (4 // PRODUCTS[dtype].group))

"""AMX tiles (jitbyoc.engines.gemm_tiles): int8 and bfloat16 products on the tile kernel
where the machine has it, edges and k tails on zero-padded copies, results equal to
numpy's (int8: exact) and to TVM's build. Built for a Sapphire Rapids target anywhere
(the IR is inspected, nothing runs); run on this machine when it has AMX."""

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.engines import gemm_tiles
from jitbyoc.render import isa
from jitbyoc.toolchain import cpu_check
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model

R = relax.op
SAPPHIRE = {"kind": "llvm", "mcpu": "sapphirerapids"}
HOST_TILES = gemm_tiles.has_tiles("int8", isa.host())
on_tiles = pytest.mark.skipif(not HOST_TILES, reason="this CPU has no AMX")


def _product_model(m, k, n, w):
    return build_model({"x": ((m, k), "uint8")},
                       lambda bb, x: bb.emit(R.matmul(x, relax.const(w), out_dtype="int32")))


def _conv_model(x_shape, w, stride, pad):
    return build_model({"x": (x_shape, "uint8")}, lambda bb, x: bb.emit(
        R.nn.conv2d(x, relax.const(w), strides=stride, padding=pad, out_dtype="int32")))


def _run(mod, x, target="llvm"):
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=tvm.target.Target(target))
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_a_sapphire_rapids_build_calls_the_tile_kernel_and_asks_for_the_tiles():
    """The product's region calls the tile engine; the CPU check asks Linux for the tile
    state (arch_prctl) and checks AMX's cpuid bits. A target without AMX (Cooper Lake:
    AVX512_BF16 and VNNI) keeps the vector kernel and asks for nothing."""
    w = np.ones((256, 64), "int8")
    for target, tiles in ((SAPPHIRE, True), ({"kind": "llvm", "mcpu": "cooperlake"}, False)):
        machine = machine_for(tvm.target.Target(target))
        with isa.compiling_for(machine):
            (region,) = jitbyoc.inspect(_product_model(64, 256, 64, w))
            assert ("jitbyoc_lib_tiles_uint8" in region.llvm_ir) == tiles, target
        check = cpu_check.module_ir(machine)
        assert ("@syscall(i64 158, i64 4131, i64 18)" in check) == tiles
        assert ("amx-int8 " in check) == tiles


def test_row_edges_run_on_the_tile_kernel():
    """A product of 5 rows (fewer than a tile's 32) still calls the tile kernel, on a
    zero-padded copy of its rows (gemm_tiled.edge_rows): the vector kernel took 2x the
    time for them (bf16 5x768x768; ViT's 197 tokens 1.27x). The optimized IR of a
    Sapphire Rapids build keeps the call (before, a static edge folded it away)."""
    machine = machine_for(tvm.target.Target(SAPPHIRE))
    with isa.compiling_for(machine):
        (region,) = jitbyoc.inspect(_product_model(5, 256, 64, np.ones((256, 64), "int8")))
        assert "jitbyoc_lib_tiles_uint8" in region.llvm_ir_optimized  # rendered for the AMX machine


def test_edges_of_at_most_16_rows_or_columns_take_half_the_tile_products():
    """An edge's tile kernel computes only the tiles of 16 that hold outputs: a 5-row
    product calls the one-row-tile kernel alone once optimized (before: the 32 x 32 one,
    two of its four tile products wasted; bf16 5x768x768 0.032 -> 0.023 ms)."""
    machine = machine_for(tvm.target.Target(SAPPHIRE))
    for (m, n), used in {(5, 64): "1_2", (40, 8): "2_1", (7, 12): "1_1"}.items():
        with isa.compiling_for(machine):
            (region,) = jitbyoc.inspect(_product_model(m, 256, n, np.ones((256, n), "int8")))
            ir_text = region.llvm_ir_optimized
        called = {v for v in ("1_1", "1_2", "2_1", "2_2") if f"jitbyoc_lib_tiles_uint8_{v}" in ir_text}
        assert used in called and "2_2" not in called, (m, n, called)


def test_a_k_tail_runs_on_the_tile_kernel():
    """The last k mod 16 units run as one more tile step on zero-padded copies
    (gemm_tiled._tail_copies), not on the vector kernel: a Sapphire Rapids build of a
    product with a 5-unit tail (k = 84) calls no vector microkernel once optimized (before,
    it did); one of less than a step (k = 40) runs on it alone."""
    machine = machine_for(tvm.target.Target(SAPPHIRE))
    for k, vectors in ((84, False), (40, True)):
        with isa.compiling_for(machine):
            (region,) = jitbyoc.inspect(_product_model(64, k, 64, np.ones((k, 64), "int8")))
            ir_text = region.llvm_ir_optimized
        on_tiles, on_vectors = "jitbyoc_lib_tiles_uint8" in ir_text, "jitbyoc_lib_micro_" in ir_text
        assert on_tiles != vectors and on_vectors == vectors, k


@on_tiles
@pytest.mark.parametrize("m, k, n", [
    (64, 256, 64),  # whole 32x32 tiles, k a multiple of 16 units
    (37, 100, 70),  # edges in M and N (5 rows copied for the tiles); k of 25 units: a tail of 9
    (5, 1540, 40),  # only an edge of rows, k in tile steps and a tail
    (128, 1540, 96),  # 385 units: 24 tile steps and a one-unit tail
    (200, 3000, 33),  # k in two blocks (the second adds into C), a one-column edge
    (1, 64, 64),  # one row
    (16, 100, 16),  # a 16 x 16 edge: one tile product a step (Tiles rows=1, cols=1)
    (20, 64, 10),  # 20 rows and 10 columns: two row tiles, one column tile
    (33, 64, 49),  # a one-row edge (one row tile) and a 17-column edge (two column tiles)
])
def test_uint8_by_int8_products_on_tiles_are_exact(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = rng.integers(0, 256, (m, k)).astype("uint8")
    w = rng.integers(-128, 128, (k, n)).astype("int8")
    got = _run(_product_model(m, k, n, w), x)
    np.testing.assert_array_equal(got, x.astype(np.int64) @ w.astype(np.int64))


@on_tiles
@pytest.mark.parametrize("c, size, k, kernel, stride, pad", [
    (64, 56, 64, 3, 1, 1),  # ResNet's 3x3: gathered, whole tiles
    (128, 29, 96, 3, 2, 1),  # strided: the gather shuffles every 2nd column
    (40, 23, 40, 5, 3, 2),  # stride 3, 250 units: tile steps and a tail of 10
    (64, 15, 32, 3, 4, 0),  # stride 4, no padding
    (37, 20, 48, 3, 1, 1),  # k of 333, no whole units: the weight packed in rows of k
    (3, 30, 16, 7, 2, 3),  # a stem (k of 147, below COLUMNS_TILES_MIN_K): the pixel engine
])
def test_int8_convolutions_gathered_for_tiles_equal_tvms(c, size, k, kernel, stride, pad):
    """Signed weights times unsigned pixels (``tdpbsud``) over im2col columns."""
    rng = np.random.default_rng(c * size)
    x = rng.integers(0, 256, (1, c, size, size)).astype("uint8")
    w = rng.integers(-128, 128, (k, c, kernel, kernel)).astype("int8")
    mod = _conv_model(x.shape, w, stride, pad)
    got = _run(mod, x)
    ex = tvm.compile(mod, target="llvm")
    want = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, want)


@on_tiles
def test_a_requantized_product_whose_chunks_move_to_whole_lines_equals_tvms():
    """A 1x1 conv of 640 pixels (20 panels of 32 columns) requantized to uint8: its chunks
    start on whole 64-byte lines (2 panels), so one is 4 panels where an even share is at
    most 3 (gemm_llvm.line_parts); its sums go to a scratch C as wide as the largest chunk
    (gemm_llvm.largest_chunk: narrower, rows overlapped)."""
    rng = np.random.default_rng(11)
    x = rng.integers(0, 256, (1, 32, 20, 32)).astype("uint8")
    w = rng.integers(-128, 128, (64, 32, 1, 1)).astype("int8")
    scale = relax.const(rng.uniform(1e-4, 4e-4, (1, 64, 1, 1)).astype("float32"))

    def body(bb, x):
        acc = R.nn.conv2d(x, relax.const(w), out_dtype="int32")
        y = R.multiply(R.astype(acc, "float32"), scale)
        return bb.emit(R.quantize(y, relax.const(np.float32(0.05)), relax.const(0, "uint8"), axis=1,
                                  out_dtype="uint8"))
    mod = build_model({"x": (x.shape, "uint8")}, body)
    tvm_build = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    np.testing.assert_array_equal(_run(mod, x), tvm_build["main"](tvm.runtime.tensor(x)).numpy())


CALL_EXPORTED = """
import sys, numpy as np, tvm
from tvm import relax
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
x = np.load(sys.argv[2])
np.save(sys.argv[3], vm["main"](tvm.runtime.tensor(x)).numpy())
assert "jitbyoc" not in sys.modules
"""


@on_tiles
@pytest.mark.skipif(shutil.which("gcc") is None, reason="export_library links with gcc")
def test_an_exported_library_asks_for_the_tiles_in_a_fresh_process(tmp_path):
    """A process that never imported jitbyoc has not asked Linux for the tile state; the
    exported library's CPU check asks before the first region runs (without it the tile
    kernel's first instruction kills the process)."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (64, 256)).astype("uint8")
    w = rng.integers(-128, 128, (256, 64)).astype("int8")
    with jitbyoc.enabled():
        ex = tvm.compile(_product_model(64, 256, 64, w), target="llvm")
    ex.export_library(str(tmp_path / "model.so"))
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", CALL_EXPORTED, str(tmp_path / "model.so"), str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), x.astype(np.int64) @ w.astype(np.int64))


@on_tiles
def test_a_product_with_a_symbolic_row_count_runs_on_tiles_at_every_size():
    """One build for any number of rows (a dynamic batch): whole 32-row tiles, edges and a
    single row, each equal to numpy's."""
    rng = np.random.default_rng(11)
    w = rng.integers(-128, 128, (320, 96)).astype("int8")
    mod = build_model({"x": (("n", 320), "uint8")},
                      lambda bb, x: bb.emit(R.matmul(x, relax.const(w), out_dtype="int32")))
    with jitbyoc.enabled():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for n in (1, 31, 64, 100):
        x = rng.integers(0, 256, (n, 320)).astype("uint8")
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(got, x.astype(np.int64) @ w.astype(np.int64))


@on_tiles
@pytest.mark.parametrize("m, k, n, batch", [(64, 256, 64, ()), (130, 771, 200, ()), (5, 40, 17, (3,))])
def test_bfloat16_products_on_tiles_sum_in_float32(m, k, n, batch):
    """The bf16 product test of tests/test_bfloat16.py on this machine's tiles (whole
    tiles, an odd k: a half-filled last pair, a k tail on the vector kernel; batches):
    within float32's summation bound of numpy's float64 product of the rounded operands."""
    from tests.test_bfloat16 import test_product_of_bfloat16_operands_is_summed_in_float32 as check

    check({"kind": "llvm"}, m, k, n, batch)


def test_k_blocks_are_whole_tile_steps():
    """With tiles, a reduction splits into blocks of whole 16-unit steps (only the last
    block may end in a tail for the vector kernel), at most kc plus one step, covering k.
    Split evenly, 512 bf16 units made three blocks of 171 units, each with an 11-unit tail
    on the vector kernel (a 1024^3 bf16 product ran at 10 % of the tile loop)."""
    from dataclasses import replace

    from llvmlite import ir

    from jitbyoc import peak
    from jitbyoc.engines import gemm, gemm_llvm
    from jitbyoc.ir.llvmtypes import I64

    blk = replace(gemm.BLOCKINGS[512, 32]["bfloat16"], mr=32, nv=2, unroll=1, tiles=True)
    module = ir.Module(name="kplan")
    fn = ir.Function(module, ir.FunctionType(ir.FloatType(), [I64, I64]), "plan")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    blocks, units = gemm_llvm.k_blocks(b, fn.args[0], blk)
    b.ret(b.sitofp(b.select(b.icmp_signed("==", fn.args[1], I64(0)), blocks, units), ir.FloatType()))
    plan, _engine = peak.jit_loop(str(module), "plan", (ctypes.c_int64, ctypes.c_int64))
    step = gemm_tiles.TILE_BYTES // 4
    for k in [1, 15, 16, 100, 192, 193, 343, 512, 1024, 1536, 2304, 4000]:
        count, each = int(plan(k, 0)), int(plan(k, 1))
        assert each % step == 0 and each <= blk.kc + step, (k, each)
        assert count * each >= k > (count - 1) * each, (k, count, each)


def test_the_next_blocks_tiles_load_between_this_blocks_products():
    """The tile kernel's loop loads the next block's operand tiles among this block's
    products (software pipelining: a product, a load, a product in one basic block), not
    all before them: tiles are not renamed, so a load placed first waits for the
    products that read its register."""
    import re

    from llvmlite import ir

    for dtype, product in (("bfloat16", "tdpbf16ps"), ("uint8", "tdpbusd")):
        module = ir.Module(name="t")
        engine = gemm_tiles.Tiles(dtype)
        engine.emit(module, ir.Function(module, engine.signature(), "tiles"))
        blocks = re.split(r'\n"?[\w.]+"?:\n', str(module))
        kinds = [["p" if product in line else "l" if "tileloadd" in line else "" for line in blk.splitlines()]
                 for blk in blocks]
        calls = ["".join(k) for k in kinds]
        assert any("plp" in c for c in calls), f"{dtype}: no block interleaves loads with products: {calls}"

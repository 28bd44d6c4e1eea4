"""The GEMM driver's row tiles (jitbyoc/engines/gemm_llvm.py: row_tiles), run as LLVM.

A product whose rows are not a multiple of the register tile's MR gets its last tiles
one row shorter instead of one thin edge tile (which costs about a full tile's time).
The products themselves are checked against TVM and numpy in test_kernel_matmul.py.
"""

import ctypes

import llvmlite.binding as llvm
import pytest
from llvmlite import ir

from jitbyoc.engines.gemm_llvm import row_tiles
from jitbyoc.ir.llvmtypes import I64, PTR
from jitbyoc.render.loops import for_range

MAX_TILES = 256


def _tiles_function(mr: int, balanced: bool):
    """``n = tiles(rows, out)``: writes (first row, rows) of every tile to ``out``."""
    module = ir.Module(name=f"tiles_{mr}_{balanced}")
    fn = ir.Function(module, ir.FunctionType(I64, [I64, PTR]), name="tiles")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    rows, out = fn.args
    count, tile = row_tiles(b, rows, mr, balanced)
    with for_range(b, count, "t") as t:
        first, height = tile(t)
        for i, v in enumerate((first, height)):
            b.store(v, b.gep(out, [b.add(b.mul(t, I64(2)), I64(i))], source_etype=I64))
    b.ret(count)
    return str(module)


@pytest.fixture(scope="module")
def tiles():
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    engines, funcs = [], {}
    for mr in (2, 6, 12):
        for balanced in (False, True):
            mod = llvm.parse_assembly(_tiles_function(mr, balanced))
            # an engine owns its target machine: one each
            engine = llvm.create_mcjit_compiler(mod, llvm.Target.from_default_triple().create_target_machine())
            engine.finalize_object()
            engines.append(engine)
            funcs[mr, balanced] = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)(
                engine.get_function_address("tiles"))

    def run(mr, balanced, rows):
        out = (ctypes.c_int64 * (2 * MAX_TILES))()
        n = funcs[mr, balanced](rows, ctypes.addressof(out))
        return [(out[2 * t], out[2 * t + 1]) for t in range(n)]
    yield run
    del engines


def _heights(tiles_, rows):
    """The tiles' heights, after checking they cover 0..rows once, in order."""
    at = 0
    for first, height in tiles_:
        assert first == at and height >= 1
        at += height
    assert at == rows
    return [h for _, h in tiles_]


def test_bert_rows_run_in_tiles_of_six_and_five(tiles):
    assert _heights(tiles(6, True, 128), 128) == [6] * 18 + [5] * 4
    assert _heights(tiles(6, False, 128), 128) == [6] * 21 + [2]


@pytest.mark.parametrize("mr", [2, 6, 12])
def test_balanced_tiles_have_no_thin_edge_where_rows_allow(tiles, mr):
    for rows in range(1, 200):
        plain = _heights(tiles(mr, False, rows), rows)
        assert plain == [mr] * (rows // mr) + ([rows % mr] if rows % mr else [])
        got = _heights(tiles(mr, True, rows), rows)
        assert len(got) == len(plain), rows  # as many microkernel calls as before
        short = (mr - rows % mr) % mr
        if rows >= short * (mr - 1):
            assert got == [mr] * (len(got) - short) + [mr - 1] * short, rows
        else:  # too few rows for that many shorter tiles: the plain split
            assert got == plain, rows

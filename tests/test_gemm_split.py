"""How the GEMM driver splits a product (jitbyoc/engines/gemm_llvm.py), run as LLVM.

- Row tiles (``row_tiles``): a product whose rows are not a multiple of the register
  tile's MR gets its last tiles one row shorter instead of one thin edge tile (which
  costs about a full tile's time).
- The side split (``split_side``): the larger one, unless it has too few parts to share
  out and the other more.
- Chunks (``chunks_of``, ``chunk_parts``): the threads' units of work are of equal size
  give or take a part, or give or take ``align`` parts where their edges move to whole
  cache lines of the output (``line_parts``).

The products themselves are checked against TVM and numpy in test_kernel_matmul.py.
"""

import ctypes
import itertools

import llvmlite.binding as llvm
import pytest
from llvmlite import ir

from jitbyoc.engines.gemm_llvm import (
    CHUNKS,
    chunk_count,
    chunk_parts,
    chunks_of,
    largest_chunk,
    row_tiles,
    split_parts,
    split_side,
)
from jitbyoc.ir.llvmtypes import I64, PTR
from jitbyoc.render.loops import for_range

MAX_TILES = 256


def _pairs_function(name: str, split):
    """``n = tiles(arg, out)``: writes the ``n`` (first, second) pairs of
    ``split(b, arg) -> (n, pair(i))`` to ``out``."""
    module = ir.Module(name=name)
    fn = ir.Function(module, ir.FunctionType(I64, [I64, PTR]), name="tiles")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    arg, out = fn.args
    count, pair = split(b, arg)
    with for_range(b, count, "t") as t:
        for i, v in enumerate(pair(t)):
            b.store(v, b.gep(out, [b.add(b.mul(t, I64(2)), I64(i))], source_etype=I64))
    b.ret(count)
    return str(module)


def _tiles_function(mr: int, balanced: bool):
    """Per row tile of ``rows``: (first row, rows)."""
    return _pairs_function(f"tiles_{mr}_{balanced}", lambda b, rows: row_tiles(b, rows, mr, balanced))


def _chunks_function(chunks: int = CHUNKS, align: int = 1):
    """Per chunk of ``parts`` (about ``chunks`` of them, edges on multiples of ``align``
    parts): (first part, end)."""
    def split(b, parts):
        count = chunk_count(b, parts, chunks)
        return count, lambda c: chunk_parts(b, c, parts, count, I64(align))
    return _pairs_function(f"chunks_{chunks}_{align}", split)


def _jit(text: str):
    """The function ``tiles`` of LLVM IR ``text``, callable, and its engine (keep alive)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(text),
                                        llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)(engine.get_function_address("tiles"))
    return fn, engine


def _pairs(fn, arg):
    out = (ctypes.c_int64 * (2 * MAX_TILES))()
    n = fn(arg, ctypes.addressof(out))
    return [(out[2 * t], out[2 * t + 1]) for t in range(n)]


@pytest.fixture(scope="module")
def tiles():
    jitted = {(mr, balanced): _jit(_tiles_function(mr, balanced)) for mr in (2, 6, 12) for balanced in (False, True)}
    yield lambda mr, balanced, rows: _pairs(jitted[mr, balanced][0], rows)
    jitted.clear()


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


def test_chunks_are_equal_give_or_take_a_part():
    fn, engine = _jit(_chunks_function())
    for parts in range(200):
        got = _pairs(fn, parts)
        assert len(got) == chunks_of(parts)
        sizes = [hi - lo for lo, hi in got]
        assert got[0][0] == 0 and got[-1][1] == parts and all(a[1] == b[0] for a, b in itertools.pairwise(got))
        assert max(sizes) - min(sizes) <= 1, parts
    # ResNet-50's 56x56 1x1 convs: 49 column panels were 7 chunks (4 for one of 2 threads, 3 for the other)
    assert [hi - lo for lo, hi in _pairs(fn, 49)] == [6, 6, 6, 6, 6, 6, 6, 7]
    # a short last chunk evens out an odd count: no more, smaller chunks
    assert [hi - lo for lo, hi in _pairs(fn, 13)] == [1, 2, 2, 2, 2, 2, 2]
    assert [hi - lo for lo, hi in _pairs(fn, 12)] == [2] * 6
    assert [chunks_of(p) for p in (1, 2, 3, 7, 8, 9, 13, 21, 200)] == [1, 2, 3, 7, 8, 5, 7, 8, 8]
    del engine


@pytest.mark.parametrize("chunks, align", [(8, 2), (16, 1), (16, 2), (8, 4)])
def test_chunk_edges_move_to_whole_lines_within_the_largest_chunk(chunks, align):
    """With ``align`` (uint8 results on tiles: 2 panels of 32 columns a 64-byte line) every
    chunk but the last starts and ends on a multiple of ``align`` parts, so no output line
    is written by two threads; no chunk outgrows :func:`largest_chunk`, the width of the
    scratch C a chunk's sums go to (wider rows would overlap the next ones)."""
    fn, engine = _jit(_chunks_function(chunks, align))
    for parts in range(1, 200):
        got = _pairs(fn, parts)
        assert len(got) == chunks_of(parts, chunks)
        assert got[0][0] == 0 and got[-1][1] == parts
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
        assert all(lo % align == 0 or lo == parts for lo, _ in got), (parts, got)
        assert max(hi - lo for lo, hi in got) <= largest_chunk(parts, chunks, align), (parts, got)
    if (chunks, align) == (8, 2):  # 20 panels (640 columns): chunks of 2 and 4, not 2 and 3
        assert [hi - lo for lo, hi in _pairs(fn, 20)] == [2, 4, 2, 4, 2, 4, 2]
    del engine


def _side_function():
    """``(1 if columns else 0, parts)`` for a product of ``m x n`` in ``batch`` items
    (packed in the argument: m << 40 | n << 20 | batch), MR 6 and NR 64."""
    def split(b, arg):
        mask = I64((1 << 20) - 1)
        m, n, batch = b.ashr(arg, I64(40)), b.and_(b.ashr(arg, I64(20)), mask), b.and_(arg, mask)
        columns, parts = split_side(b, (m, n), (I64(6), I64(64)), batch, CHUNKS)
        return I64(1), lambda _: (b.zext(columns, I64), parts)
    return _pairs_function("side", split)


@pytest.mark.parametrize("m, n, batch, want", [
    (128, 196, 1, (0, 22)),   # 14x14: panels 64, 64, 64, 4 for two threads; 22 row parts
    (64, 196, 1, (0, 11)),    # MobileNetV2's 14x14 projections
    (32, 49, 1, (0, 6)),      # a 7x7 map is one panel: it was one task
    (128, 128, 12, (1, 2)),   # BERT's scores: 24 chunks over the heads already
    (64, 3136, 1, (1, 49)),   # 56x56: columns, as before
    (128, 784, 1, (1, 13)),   # 28x28: 13 panels are enough
    (1024, 196, 1, (0, 171)),  # rows are the larger side
    (4, 40, 1, (1, 1)),       # one panel, one row part: nothing to share
])
def test_the_split_side_has_parts_to_share(m, n, batch, want):
    fn, engine = _jit(_side_function())
    assert _pairs(fn, m << 40 | n << 20 | batch) == [want]
    del engine
    assert split_parts(m, n, 6, 64, batch, CHUNKS) == (bool(want[0]), want[1])  # the cost models' copy

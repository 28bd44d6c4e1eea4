"""The GEMM's panel packers (:mod:`jitbyoc.engines.gemm_micro`): a transposed B's whole
blocks plainly and edges masked; a row-major B's panels all in one pass along k; both
right at every edge when built for AVX2, whose 16-wide panels are always packed."""

import re

import pytest
import tvm

import jitbyoc
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.test_kernel_matmul import arrays, case, check, model, run

HASWELL = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})


def packer_ir(kind: str, width: int) -> str:
    """The optimized IR of a ``kind`` packer of ``width``-wide panels for AVX2."""
    from llvmlite import ir

    from jitbyoc.toolchain import jit
    from jitbyoc.engines.gemm_micro import call_packer
    from jitbyoc.ir.llvmtypes import I64, PTR

    with isa.compiling_for(machine_for(HASWELL)):
        module = ir.Module(name="pack")
        module.triple, module.data_layout = isa.current().triple, jit.data_layout()
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64, I64]), "caller")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        call_packer(b, kind, "float32", *fn.args, width)
        b.ret_void()
        return jit.optimize(str(module))


@pytest.mark.parametrize("width", [16, 32, 12])
def test_whole_blocks_are_packed_without_masks(width):
    """A 16 x 16 block inside the panel (16 float32 lanes: one AVX-512 register, two
    AVX2 ones) is 16 plain loads and 16 plain stores; only edge blocks are masked (AVX2's
    masked loads and stores cost Zen 4 several plain ones: with every block masked, the
    pack took a third of a 64-row AVX2 linear layer's time). A panel whose last group of
    rows is partial (12 of 16) masks that group always."""
    text = packer_ir("transposed", width)
    plain_loads = len(re.findall(r"= load <16 x float>", text))
    plain_stores = len(re.findall(r"store <16 x float>", text))
    assert (plain_loads >= 16 and plain_stores >= 16) == (width % 16 == 0), (plain_loads, plain_stores)
    assert "llvm.masked.load" in text and "llvm.masked.store" in text  # the edges


@pytest.mark.parametrize("rows", [17, 64])
def test_packed_products_for_avx2_match_numpy_at_every_edge(rows):
    """Products whose B is read transposed or row-major, built for AVX2: K and N around
    multiples of the 16-lane block (whole blocks, a partial last k block, a partial last
    row group or panel, many panels of a 1000-wide B), against numpy and TVM's default
    build."""
    cases = [case((rows, k), (n, k), linear=True) for k, n in [(130, 129), (64, 64), (9, 7), (100, 24)]]
    cases += [case((rows, 130), (129, 130), perm_b=[1, 0])]
    cases += [case((rows, k), (k, n)) for k, n in [(130, 129), (64, 64), (9, 7), (100, 24), (33, 1000)]]
    mod = model(cases)
    with jitbyoc.enabled():
        jit_ex = tvm.compile(mod, target=HASWELL)
    assert not jitbyoc.last_report().fallbacks
    with jitbyoc.disabled():
        tvm_ex = tvm.compile(mod, target="llvm")
    args = arrays(cases, seed=rows)
    check(cases, args, run(jit_ex, args), run(tvm_ex, args))


def test_row_panels_are_packed_in_one_pass_along_k():
    """The row packer walks k once for all its panels (inner loop over panels), so each
    k row is read as one stream: a panel at a time read one line per k row, rows a page
    apart in a 1024-wide B."""
    text = packer_ir("rows", 16)
    labels = re.findall(r"\n([\w.]+):", text)
    first = {loop: next((i for i, x in enumerate(labels) if x.startswith(f"{loop}.body")), None)
             for loop in ("pk", "pq")}
    assert None not in first.values() and first["pk"] < first["pq"], labels  # panels inside k

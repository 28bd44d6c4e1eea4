"""The zoo suite's builds of one model (:mod:`bench.zoo_run` measures them): the frontend
import, the lowering to ``--precision`` (bf16: ``jitbyoc.lower_precision``; int8: the
model's QDQ copy, :mod:`bench.qdq`; fp16: its float16 copy, :mod:`bench.fp16`; both
through TVM's ONNX frontend), jitbyoc's cold build and TVM's default build of the module
that results, and (bf16, int8, fp16) the outputs of jitbyoc's fp32 build of the fp32
model, the accuracy columns' reference, built once and kept: the narrow build's speed-up over
it is a column of the row (issue 42's "3x faster than jitbyoc fp32", measured in turns).
"""

from __future__ import annotations

from . import peers as peers_mod
from . import qdq
from . import target as build_target
from .case import Skip
from .flops import count_flops
from .models import Entry
from .run import failure, vm_runner
from .timing import timed

# the precisions whose module is a copy of the model's ONNX file: what the copy is called
# and the row's fields of its making, import and path
COPIES = {"int8": ("int8 QDQ copy", "quantize_s", "qdq_import_s", "qdq_file"),
          "fp16": ("fp16 copy", "fp16_convert_s", "fp16_import_s", "fp16_file")}


def build(entry: Entry, mod, run_tvm: bool = True) -> dict | Skip:
    """jitbyoc's cold build of ``mod``, and TVM's default build, timed for every model (the
    build-time goal is against it) but kept to run only if ``entry.tvm_default`` and
    ``run_tvm``."""
    import tvm

    import jitbyoc

    def jit_build():
        with jitbyoc.enabled():
            return tvm.compile(mod, target=build_target.current()), jitbyoc.last_report()

    def tvm_build():
        return build_target.build(mod, offload=False)

    try:
        (ex_jit, report), seconds = timed(jit_build)
    except Exception as err:
        return failure(entry, "build", err)
    built = {"ex_jit": ex_jit, "report": report, "build_cold_jitbyoc_s": seconds, "build_tvm_s": None}
    try:  # TVM alone may fail where jitbyoc builds (float16 ResNet-50): a note, not a skip
        ex_tvm, built["build_tvm_s"] = timed(tvm_build)
    except Exception as err:
        built["tvm_error"] = failure(entry, "TVM's default build", err).reason
        return built
    if entry.tvm_default and run_tvm:
        built["ex_tvm"] = ex_tvm
    del ex_tvm  # the big models' weights, once more
    return built


def copy_module(entry: Entry, files: peers_mod.ModelFiles,
                precision: str) -> tuple[object, dict] | Skip:
    """The model's copy at ``precision`` (a key of :data:`COPIES`; made, or found in the
    cache) as a Relax module, through TVM's ONNX frontend, and the row's fields about it;
    a Skip if there is no copy."""
    what, make_key, import_key, file_key = COPIES[precision]
    _, why = files.onnx  # the fp32 file first: its export is not the copy's time
    if why:
        return Skip(f"no {what}: {why}")
    (path, why), seconds = timed(lambda: files.path(precision))
    if why:
        return Skip(f"no {what}: {why}")
    try:
        mod, import_s = timed(lambda: qdq.import_onnx(path))
    except Exception as err:
        return failure(entry, f"importing the {what}", err)
    return mod, {"precision": precision, make_key: seconds, import_key: import_s, file_key: path}


def lower(entry: Entry, case, precision: str, files: peers_mod.ModelFiles,
          activations: str = "float32") -> tuple[object, dict] | Skip:
    """The module jitbyoc builds at ``precision`` and the row's fields about it
    (``activations``: :func:`jitbyoc.lower_precision`'s, at bf16)."""
    if precision == "fp32":
        return case.mod, {"precision": "fp32"}
    if precision in COPIES:
        return copy_module(entry, files, precision)
    import jitbyoc

    try:
        mod, seconds = timed(lambda: jitbyoc.lower_precision(case.mod, precision, activations))
    except Exception as err:
        return failure(entry, f"lower_precision to {precision}", err)
    lowered = count_flops(mod, operand_dtype="bfloat16")
    return mod, {"precision": precision, "activations": activations, "lower_s": seconds,
                 "lowered_gflop": lowered / 1e9}


def fp32_build(case) -> tuple[list, object]:
    """jitbyoc's fp32 build of ``case``: its outputs (the accuracy columns' reference) and
    the executable (timed beside the narrow build, ``jitbyoc_fp32``)."""
    import tvm

    import jitbyoc

    with jitbyoc.enabled():
        ex = tvm.compile(case.mod, target=build_target.current())
    return peers_mod.as_numpy(vm_runner(ex, case.inputs)()), ex


def prepare(entry: Entry, precision: str, workdir: str, activations: str = "float32") -> tuple | Skip:
    """Import the model, lower it to ``precision``, build it both ways; a Skip if any fails.

    Returns ``(case, fields, built, reference, files)``: the case, the row's fields so
    far, :func:`build`'s executables and times (bf16, int8, fp16: also the fp32 build's,
    ``ex_fp32``), the fp32 build's outputs or None (fp32), and the model's files for the
    peers (its ONNX file, QDQ and float16 copies, written in ``workdir`` and the copies'
    cache directories when first asked for).
    """
    try:
        case, import_s = timed(entry.make)
    except Exception as err:
        return failure(entry, "making the model", err)
    if isinstance(case, Skip):
        return case
    files = peers_mod.ModelFiles(case, workdir, entry.name)
    lowered = lower(entry, case, precision, files, activations)
    if isinstance(lowered, Skip):
        return lowered
    mod, fields = lowered
    # float16: TVM's build sums products in float16 and ran SqueezeNet 1600x slower than
    # jitbyoc (8.1 s a call): built and timed, not run (the fp32 build is the reference)
    built = build(entry, mod, run_tvm=precision != "fp16")
    if isinstance(built, Skip):
        return built
    built["build_cold_jitbyoc_s"] += fields.get("lower_s", 0.0)  # lowering is part of it
    reference = None
    try:  # after the cold build, so its regions are not served from this build's cache
        if precision != "fp32":
            reference, built["ex_fp32"] = fp32_build(case)
    except Exception as err:
        return failure(entry, "the fp32 reference build", err)
    return case, {"import_s": import_s, **fields}, built, reference, files

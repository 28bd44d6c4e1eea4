"""Fail at import when TVM's LLVM and llvmlite's LLVM have different major versions:
jitbyoc renders IR with one and TVM parses it with the other, and IR text is only
compatible within one major version."""

from __future__ import annotations

import llvmlite.binding as llvm
import tvm


class IncompatibleLLVM(ImportError):
    pass


def check_llvm_majors() -> tuple[int, int]:
    lite = llvm.llvm_version_info[0]
    fn = tvm.get_global_func("target.llvm_version_major", allow_missing=True)
    if fn is None:
        raise IncompatibleLLVM("jitbyoc: this TVM build has no LLVM backend "
                               "(target.llvm_version_major is missing); install apache-tvm with LLVM")
    tvm_major = int(fn())
    if tvm_major != lite:
        raise IncompatibleLLVM(
            f"jitbyoc: TVM is built with LLVM {tvm_major} but llvmlite with LLVM {lite}; "
            f"install matching versions (apache-tvm 0.27.x with llvmlite 0.50.x, both LLVM 22)")
    return tvm_major, lite

"""A region's build artifact: its kernel IR and every rendering of it, made on first
access (LLVM IR before and after optimization, assembly, C source, the engines it calls,
the pipeline it is compiled with). It knows nothing of caches, workers or TVM modules:
that is :mod:`jitbyoc.toolchain.driver`'s work."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..engines import used_by as engines_declared
from ..ir import kir
from ..ir.errors import CompileError, error_context
from ..lower import Names
from ..render import abi, isa, optimization
from ..render.llvm import release as release_module
from . import jit
from .c_entry import emit_c
from .llvm_entry import Rendered, emit_llvm


@dataclass
class Region:
    """One offloaded region and every rendering of it, made on first access.

    ``symbol`` names this use of the region (TVM calls ``__tvm_ffi_<symbol>``);
    ``kernel.name`` names its code, which every use with the same kernel shares; ``names``
    holds the user's names that this use's error messages show."""
    symbol: str
    kernel: kir.Kernel
    names: Names
    key: str = field(default="", repr=False)  # the kernel's canonical text (jitbyoc.ir.kir.canonical)

    @property
    def arg_names(self) -> list[str]:
        return list(self.names.args)

    @cached_property
    def texts(self) -> list[str]:
        """This use's names table (:func:`jitbyoc.render.abi.strings`)."""
        return abi.strings(self.kernel, self.symbol, self.names.args, self.names.size_display)

    @cached_property
    def rendered(self) -> Rendered:
        """The LLVM module and what rendering it found out."""
        return emit_llvm(self.kernel, isa.current().triple, jit.data_layout())

    @property
    def llvm_module(self):
        return self.rendered.module

    @cached_property
    def llvm_ir(self) -> str:
        """LLVM IR before optimization."""
        return str(self.llvm_module)

    @cached_property
    def pipeline(self) -> optimization.Pipeline:
        """How this region is optimized: without the loop vectorizer when its loops are
        all explicit vectors."""
        return optimization.for_region(self.rendered.facts.needs_loop_vectorizer)

    @cached_property
    def engines(self) -> set[str]:
        """The library engines this region calls (:mod:`jitbyoc.engines`)."""
        return engines_declared(self.llvm_module)

    @cached_property
    def llvm_ir_optimized(self) -> str:
        """LLVM IR after optimization for the host CPU (what the build compiles)."""
        with error_context(CompileError, self.symbol, "optimizing its IR"):
            return jit.optimize(self.llvm_ir, self.pipeline)

    @cached_property
    def asm(self) -> str:
        """Host assembly; this is what runs."""
        with error_context(CompileError, self.symbol):
            return jit.compile_to_assembly(self.llvm_ir, self.pipeline)

    def release(self) -> None:
        """Free the rendered module now, keeping what is derived from it (IR text,
        pipeline, engines); builds call this once a region is submitted (see
        :func:`jitbyoc.render.llvm.release`)."""
        if "rendered" in self.__dict__:
            self.llvm_ir, self.pipeline, self.engines  # noqa: B018 - cached before the module goes
            release_module(self.__dict__.pop("rendered").module)

    @cached_property
    def c_source(self) -> str:
        return emit_c(self.kernel, self.symbol, self.texts)

"""Library engines: heavy kernels compiled once per machine and shared by every region.

The package holds the engine registry (:mod:`.registry`: the :class:`Engine` base, symbols,
declaring and calling an engine from a region) and every engine: the argument checks
(:mod:`.args`), the packed GEMM (:mod:`.gemm` describes a product, :mod:`.gemm_engine`
is its library engine, :mod:`.gemm_llvm` and :mod:`.gemm_micro` its driver and
microkernels) and the direct convolution (:mod:`.conv_engine`, planned by
:mod:`.conv_plan`). Importing the package registers them all, so :func:`parse` knows
every kind. Arrows point one way: IR < renderers (:mod:`jitbyoc.render`) < engines <
kernels (:mod:`jitbyoc.kernels`).
"""

from __future__ import annotations

from dataclasses import fields

from . import args, conv_engine, gemm_engine  # noqa: F401 - each registers its engine kinds
from .registry import KINDS, PREFIX, Engine, ir_text, references, use, used_by


def parse(symbol: str) -> Engine:
    """The engine named ``symbol`` (see :attr:`Engine.symbol`)."""
    name, *values = symbol[len(PREFIX):].split("_")
    cls = KINDS[name]
    return cls(*[int(v) if f.type in ("int", int) else v for f, v in zip(fields(cls), values)])


__all__ = ["KINDS", "PREFIX", "Engine", "ir_text", "parse", "references", "use", "used_by"]

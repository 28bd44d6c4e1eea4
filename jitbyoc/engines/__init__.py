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


def called_by(text: str) -> set[str]:
    """The engines that assembly or IR ``text`` names: a region's, or an engine's, which
    may call others (a GEMM engine its microkernels) and names its own helpers after
    itself (``<symbol>_par0``: not engines)."""
    return {s for s in references(text) if _names_an_engine(s)}


def _names_an_engine(symbol: str) -> bool:
    try:
        return parse(symbol).symbol == symbol
    except (KeyError, TypeError, ValueError):
        return False


def closure(symbols, text_of) -> dict[str, str | None]:
    """``symbols`` and every engine they call, directly or not: symbol -> ``text_of(symbol)``
    (its assembly or IR, or None when unknown yet, whose callees are then not followed)."""
    found: dict[str, str | None] = {}
    todo = sorted(symbols)
    while todo:
        symbol = todo.pop()
        if symbol not in found:
            found[symbol] = text_of(symbol)
            todo += sorted(called_by(found[symbol] or "") - found.keys())
    return found


__all__ = ["KINDS", "PREFIX", "Engine", "called_by", "closure", "ir_text", "parse", "references", "use",
           "used_by"]

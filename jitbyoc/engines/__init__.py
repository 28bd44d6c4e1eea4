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

from . import args, conv_engine, conv_tiles, gemm_engine, winograd  # noqa: F401 - each registers its engine kinds
from .registry import KINDS, PREFIX, Engine, emitted, ir_text, use, used_by


def parse(symbol: str) -> Engine:
    """The engine named ``symbol`` (see :attr:`Engine.symbol`)."""
    name, *values = symbol[len(PREFIX):].split("_")
    cls = KINDS[name]
    return cls(*[int(v) if f.type in ("int", int) else v for f, v in zip(fields(cls), values)])


def emit(engine: Engine, triple: str, data_layout: str) -> tuple[str, frozenset[str]]:
    """The engine's LLVM IR and the engines it calls (a GEMM engine its microkernels), as
    its module declares them; not its own helpers (``<symbol>_par0``), which are named
    after it."""
    text, named = emitted(engine, triple, data_layout)
    return text, frozenset(s for s in named if _names_an_engine(s))


def _names_an_engine(symbol: str) -> bool:
    try:
        return parse(symbol).symbol == symbol
    except (KeyError, TypeError, ValueError):
        return False


def closure(symbols, callees_of) -> list[str]:
    """``symbols`` and every engine they call, directly or not, in the order visited;
    ``callees_of(symbol)`` gives what ``symbol`` calls (None when unknown yet: not followed)."""
    found: dict[str, None] = {}  # ordered, and a set for the membership tests
    todo = sorted(symbols)
    while todo:
        symbol = todo.pop()
        if symbol not in found:
            found[symbol] = None
            todo += sorted(set(callees_of(symbol) or ()) - found.keys())
    return list(found)


__all__ = ["KINDS", "PREFIX", "Engine", "closure", "emit", "ir_text", "parse", "use", "used_by"]

"""Errors that name where they happened: the region, and the op or stage inside it.

Each step of the pipeline runs its pieces inside :func:`error_context` (as numba's
``new_error_context``): an unexpected exception from lowering an op, rendering a stage or
compiling a region comes out as the step's error type, naming the region and the op, with
the original exception chained. The innermost context names it; outer ones let it pass.
"""

from __future__ import annotations

from contextlib import contextmanager


class JitbyocError(RuntimeError):
    """jitbyoc could not lower, render or compile a region. ``subject`` is what failed
    (the Relax call, for a lowering error), when known."""
    subject = None


class LoweringError(JitbyocError):
    """A region could not be lowered to kernel IR."""


class RegionSizeError(LoweringError):
    """The region's boundary leaves a symbolic size its arguments do not define. Not a
    failure of any op: region formation (:mod:`jitbyoc.tvm.partition`) forms the regions
    again without the call that makes the size (``subject``), or without the region."""


class RenderError(JitbyocError):
    """Kernel IR could not be rendered to LLVM IR or C."""


class CompileError(JitbyocError):
    """LLVM could not compile a region's or an engine's IR."""


STEP = {LoweringError: "lowering", RenderError: "rendering", CompileError: "compiling"}


@contextmanager
def error_context(kind: type[JitbyocError], region: str, what: str | None = None, subject=None):
    """Re-raise anything but a :class:`JitbyocError` as ``kind``, naming ``region`` and
    ``what`` (an op or a stage); ``subject`` goes with it."""
    try:
        yield
    except JitbyocError as err:
        if err.subject is None:
            err.subject = subject
        raise
    except Exception as err:
        where = f"region '{region}'" + (f", {what}" if what else "")
        new = kind(f"jitbyoc: {STEP[kind]} {where} failed: {type(err).__name__}: {err}")
        new.subject = subject
        raise new from err

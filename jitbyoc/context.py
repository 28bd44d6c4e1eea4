"""Scoped settings: a context variable set for the duration of a ``with`` block (the build's
machine, the region whose sizes are being named, a C-source build). A leaf module."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar


@contextmanager
def scoped(var: ContextVar, value):
    """``var`` is ``value`` inside the block (this thread or task only), as before after it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)

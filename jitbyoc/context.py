"""Settings. Scoped ones: a context variable set for the duration of a ``with`` block (the
build's machine, the region whose sizes are being named, a C-source build). And numbers
read from the environment (:func:`env_number`). A leaf module."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar

log = logging.getLogger("jitbyoc")


@contextmanager
def scoped(var: ContextVar, value):
    """``var`` is ``value`` inside the block (this thread or task only), as before after it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def env_number(name: str, default, kind=int):
    """``kind(os.environ[name])``, or ``default`` when unset or not a number of that kind
    (with a warning naming the variable: a typo in a setting must not fail an import or
    a build)."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return kind(text)
    except ValueError:
        log.warning("jitbyoc: %s=%r is not %s; using %r", name, text,
                    "an integer" if kind is int else "a number", default)
        return default

"""The TVM target a benchmark process builds for: ``--target`` (default ``llvm``, this
machine). Both jitbyoc and TVM default build for it, so ratios stay like for like; the
FMA peak behind "% of peak" is measured for that target's vector ISA.

``--target`` takes a TVM target as JSON (``'{"kind": "llvm", "mcpu": "haswell"}'``),
``llvm``, or a bare CPU name (``haswell``: ``{"kind": "llvm", "mcpu": "haswell"}``).
"""

from __future__ import annotations

import json

import tvm

from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for

_TARGET: list = ["llvm"]


def parse(text: str):
    """A target spec as ``tvm.target.Target`` takes it."""
    text = text.strip()
    if text.startswith("{"):
        return json.loads(text)
    return text if text in ("llvm", "c") else {"kind": "llvm", "mcpu": text}


def set_target(text: str | None) -> None:
    _TARGET[0] = parse(text) if text else "llvm"


def current() -> tvm.target.Target:
    return tvm.target.Target(_TARGET[0])


def build(mod, offload: bool, target=None):
    """``tvm.compile(mod)`` for ``target`` (default: the benchmark's), jitbyoc on or off."""
    import jitbyoc

    with (jitbyoc.enabled() if offload else jitbyoc.disabled()):
        return tvm.compile(mod, target=target or current())


def machine() -> isa.Machine:
    """The machine the target names (the host for plain ``llvm``)."""
    m = machine_for(current())
    if isinstance(m, str):
        raise ValueError(f"jitbyoc does not compile for {_TARGET[0]}: {m}")
    return m


def describe() -> str:
    m = machine()
    spec = _TARGET[0] if isinstance(_TARGET[0], str) else json.dumps(_TARGET[0])
    return f"target {spec} = {m.describe()}"

"""``relax.ext.jitbyoc``: the codegen TVM's ``RunCodegen`` calls with the partitioned
regions. Each region function becomes a :class:`~jitbyoc.toolchain.region.Region` (its
lowering comes from the build's session, filled in by partitioning) and the build driver
turns them into one runtime module.

Inside ``tvm.compile`` the hook builds that module before ``RunCodegen`` (:func:`build_module`),
outside TVM's turn (:data:`jitbyoc.tvm.turn.TVM_TURN`), so the codegen only hands it over;
the session is found by the id the hook put in ``RunCodegen``'s options."""

from __future__ import annotations

import tvm
from tvm import relax

from ..lower import lower_region
from ..profile import remember
from ..toolchain import driver, session
from ..toolchain.region import Region
from ..toolchain.session import BuildSession


def region_of(func, build: BuildSession | None = None) -> Region:
    """The build artifact of one partitioned region function."""
    low = build.lowering_of(func) if build is not None else None
    if low is None:
        low = lower_region(func)
    return Region(str(func.attrs["global_symbol"]), low.kernel, low.names, low.key)


def build_module(functions, build: BuildSession):
    """The runtime module of the region ``functions`` (None when there are none), kept in
    the session for :func:`_codegen`. The profiler learns each region's work."""
    regions = [region_of(f, build) for f in functions]
    for r in regions:
        remember(r.symbol, r.kernel)
    module = driver.build_regions(regions, build) if regions else None
    build.modules[frozenset(r.symbol for r in regions)] = module
    return module


def _codegen(functions, options, constant_names):
    found = session.find(options)
    if found is None:  # RunCodegen run by hand: a session of its own
        found = BuildSession()
        session.remember(found)
        module = build_module(functions, found)
    else:
        held, module = found.module_for(str(f.attrs["global_symbol"]) for f in functions)
        if not held:
            module = build_module(functions, found)
    return [module] if module is not None else []


def run_codegen(mod: tvm.IRModule, build: BuildSession) -> tvm.IRModule:
    """TVM's ``RunCodegen`` on ``mod``, with ``build`` for the codegen to find."""
    return relax.transform.RunCodegen(target_options={"jitbyoc": {session.OPTION: build.id}})(mod)


def register() -> None:
    for name in ("relax.ext.jitbyoc", "relay.ext.jitbyoc"):
        tvm.register_global_func(name, _codegen, override=True)

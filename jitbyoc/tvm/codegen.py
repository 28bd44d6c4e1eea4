"""``relax.ext.jitbyoc``: the codegen TVM's ``RunCodegen`` calls with the partitioned
regions. Each region function becomes a :class:`~jitbyoc.toolchain.region.Region` (its
lowering comes from the partition, :func:`jitbyoc.tvm.partition.lowered`) and the build
driver turns them into one runtime module."""

from __future__ import annotations

import tvm

from ..toolchain import driver
from ..toolchain.region import Region
from ..profile import remember
from .partition import lowered


def region_of(func) -> Region:
    """The build artifact of one partitioned region function."""
    low = lowered(func)
    return Region(str(func.attrs["global_symbol"]), low.kernel, low.names, low.key)


def _codegen(functions, options, constant_names):
    regions = [region_of(f) for f in functions]
    for r in regions:
        remember(r.symbol, r.kernel)
    module = driver.build_regions(regions)
    return [module] if module is not None else []


def register() -> None:
    for name in ("relax.ext.jitbyoc", "relay.ext.jitbyoc"):
        tvm.register_global_func(name, _codegen, override=True)

"""Which build targets jitbyoc compiles for: this machine's.

jitbyoc specializes its code for the host CPU (AVX-512 here). A build whose TVM target
names another machine -- another architecture (``mtriple``), another CPU (``mcpu``), or
features the host lacks or the target removes (``mattr``) -- would get code that the
target may not run (SIGILL on a CPU without AVX-512, x86-64 code in an AArch64 library).
Until code generation follows the target, such a build is left to TVM whole, and the
offload report says why. Plain ``"llvm"`` (no CPU named) means this machine.
"""

from __future__ import annotations

from ..build import jit


def _features(flat: str) -> dict[str, bool]:
    return {f[1:]: f[0] == "+" for f in flat.split(",") if f and f[0] in "+-"}


def host_mismatch(target) -> str | None:
    """Why jitbyoc cannot compile for ``target`` (a ``tvm.target.Target`` or None), or
    None when the target is this machine."""
    if target is None or target.kind.name != "llvm":
        return None
    attrs, host = target.attrs, jit.host()
    triple = str(attrs.get("mtriple") or "")
    arch = host["triple"].split("-")[0]
    if triple and triple.split("-")[0] != arch:
        return f"target triple {triple}: jitbyoc compiles for this machine ({arch}) only"
    cpu = str(attrs.get("mcpu") or "")
    if cpu and cpu not in (host["cpu"], "native"):
        return (f"target mcpu={cpu}: jitbyoc compiles for this machine's CPU ({host['cpu']}) "
                f"only; its code could use instructions {cpu} lacks")
    have = _features(host["features"])
    for feat in (str(a) for a in (attrs.get("mattr") or ())):
        name, on = feat.lstrip("+-"), not feat.startswith("-")
        if have.get(name, False) != on:
            return (f"target mattr {feat}: jitbyoc compiles for this machine's features "
                    f"({'has' if have.get(name) else 'lacks'} {name}) only")
    return None

"""The packed-function entry in C: walks :func:`jitbyoc.render.abi.plan`.

The user's names are data: they sit in one array of escaped string literals
(``jb_names``, the names table of :func:`jitbyoc.render.abi.strings`) and reach the
messages as ``%s`` arguments; every identifier is jitbyoc's.
"""

from __future__ import annotations

from ..ir import kir
from ..ir.errors import RenderError, error_context
from ..render import abi
from ..render.c import PRELUDE, emit_compute, storage_c


def c_string(text: str) -> str:
    """``text`` as a C string literal: printable ASCII as is, everything else (quotes,
    backslashes, ``?`` against trigraphs, control characters, UTF-8 bytes) in octal."""
    safe = {c for c in range(0x20, 0x7F)} - {ord('"'), ord("\\"), ord("?")}
    data = text.encode("utf-8", "backslashreplace")
    return '"' + "".join(chr(c) if c in safe else f"\\{c:03o}" for c in data) + '"'


def emit_c(kernel: kir.Kernel, symbol: str, texts: list[str]) -> str:
    """The kernel as one C translation unit: ``<name>_compute`` plus ``__tvm_ffi_<symbol>``
    reporting errors with the names table ``texts`` (:func:`.abi.strings`)."""
    functions: list[str] = []
    compute = emit_compute(kernel, functions)
    return "\n".join([PRELUDE, *functions, *compute, "", *_entry(kernel, symbol, texts), ""])


def emit_c_unit(regions) -> str:
    """Regions (:class:`~jitbyoc.toolchain.region.Region`) as one C translation unit: the
    prelude once, each distinct code once, an entry ``__tvm_ffi_<symbol>`` per region
    (what a ``target="c"`` build exports, :func:`jitbyoc.toolchain.runtime.c_source_module`)."""
    parts, done = [PRELUDE], set()
    for r in regions:
        if r.kernel.name not in done:
            done.add(r.kernel.name)
            functions: list[str] = []
            compute = emit_compute(r.kernel, functions)
            parts += [*functions, *compute]
        parts += ["", *_entry(r.kernel, r.symbol, r.texts)]
    return "\n".join(parts + [""])


def _entry(kernel: kir.Kernel, symbol: str, texts: list[str]) -> list[str]:
    """The entry's lines, errors naming the region."""
    with error_context(RenderError, symbol, "its entry (the argument checks) in C"):
        return emit_entry(kernel, symbol, texts)


class Entry:
    """The C entry's body as it is written: each check of :func:`.abi.plan` adds its
    statements with :meth:`line` and :meth:`fail_if`."""

    def __init__(self):
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append("  " + text)

    @staticmethod
    def string(chk, k: int) -> str:
        """String ``k`` of ``chk``'s strings, from this use's names table."""
        return f"names[{chk.strings[k]}]"

    def fail_if(self, cond: str, chk, *values) -> None:
        """Raise ``chk.message`` formatted with ``values`` (C expressions, in the
        message's order) when ``cond`` holds."""
        self.line(f"if ({cond}) {{ snprintf(msg, sizeof msg, {', '.join([c_string(chk.message), *values])}); "
                  f"TVMFFIErrorSetRaisedFromCStr(\"ValueError\", msg); return -1; }}")


def emit_entry(kernel: kir.Kernel, symbol: str, texts: list[str]) -> list[str]:
    entry = Entry()
    for chk in abi.plan(kernel):
        chk.emit_c(entry)
    ptrs = [f"({storage_c(p.dtype)}*)((char*)jb_ptr_at(dl{i}, {abi.DL_DATA}) + jb_i64_at(dl{i}, {abi.DL_BYTE_OFFSET}))"
            for i, p in enumerate(kernel.params)]
    return [f"static const char* const jb_names_{symbol}[] = {{",
            *[f"  {c_string(t)}," for t in texts], "};",
            f"JB_EXPORT int32_t __tvm_ffi_{symbol}(void* self, const TVMFFIAny* args, int32_t num_args, "
            f"TVMFFIAny* ret) {{",
            "  char msg[1024];",
            f"  const char* const* names = jb_names_{symbol};",
            "  (void)self; (void)ret;",
            *entry.lines,
            f"  return {kernel.name}_compute({', '.join(ptrs + kernel.sym_vars)});",
            "}"]

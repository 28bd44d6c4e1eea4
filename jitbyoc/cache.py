"""The compile cache: a region's assembly, in memory and on disk, keyed by its content.

A key covers the region's content (its symbol is a structural hash of the Relax
function), the jitbyoc version plus a digest of jitbyoc's own source, TVM's version, and
the host (triple, CPU, features, LLVM and llvmlite versions). On disk each entry is one
file written atomically (temp file + ``os.replace``) in a directory only the user can
write; the file starts with a SHA-256 of its payload, so a corrupt or truncated entry
is detected, ignored and rewritten. The directory is bounded: least recently used
entries (by modification time, refreshed on every hit) are evicted past ``max_bytes``;
the directory is scanned for that only when this process's running estimate of its size
(the last scan plus what the process wrote since) passes the bound, not on every write
(a scan of a full cache, ~8,000 entries, takes ~50 ms).

Location: ``$JITBYOC_CACHE_DIR``, else ``$XDG_CACHE_HOME/jitbyoc``, else
``~/.cache/jitbyoc``. ``JITBYOC_CACHE=0`` disables the disk cache; so does
``jitbyoc.cache.configure(enabled=False)``, which can also move it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("jitbyoc")

MAGIC = b"jitbyoc-cache-v1\n"
_LOCK = threading.Lock()
_MEMORY: OrderedDict[str, str] = OrderedDict()
MEMORY_ENTRIES = 4096


class _Settings:
    def __init__(self):
        self.path: Path | None = None
        self.enabled: bool | None = None
        self.max_bytes = int(os.environ.get("JITBYOC_CACHE_MAX_BYTES", 256 << 20))

    def directory(self) -> Path | None:
        enabled = self.enabled if self.enabled is not None else \
            os.environ.get("JITBYOC_CACHE", "1").lower() not in ("0", "false", "off", "no")
        if not enabled:
            return None
        if self.path is not None:
            return self.path
        if os.environ.get("JITBYOC_CACHE_DIR"):
            return Path(os.environ["JITBYOC_CACHE_DIR"])
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "jitbyoc"


SETTINGS = _Settings()


def configure(path: str | os.PathLike | None = None, enabled: bool | None = None,
              max_bytes: int | None = None) -> None:
    """Move (``path``), switch (``enabled``) or bound (``max_bytes``) the disk cache.

    ``None`` leaves a setting as it is; environment variables apply where no call set one.
    """
    if path is not None:
        SETTINGS.path = Path(path)
    if enabled is not None:
        SETTINGS.enabled = enabled
    if max_bytes is not None:
        SETTINGS.max_bytes = int(max_bytes)


def clear_memory() -> None:
    with _LOCK:
        _MEMORY.clear()


@lru_cache(maxsize=None)
def code_version() -> str:
    """jitbyoc's version and a digest of its source: editing jitbyoc invalidates the cache."""
    from . import __version__

    root = Path(__file__).parent
    h = hashlib.sha256(__version__.encode())
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return f"{__version__}+{h.hexdigest()[:16]}"


@lru_cache(maxsize=None)
def _environment() -> str:
    import tvm

    from . import jit
    return json.dumps({"jitbyoc": code_version(), "tvm": tvm.__version__, **jit.host()}, sort_keys=True)


def key(symbol: str) -> str:
    return hashlib.sha256(f"{symbol}\n{_environment()}".encode()).hexdigest()


def get(k: str) -> tuple[str | None, str]:
    """(assembly, where it came from: "memory", "disk" or "miss")."""
    with _LOCK:
        if k in _MEMORY:
            _MEMORY.move_to_end(k)
            return _MEMORY[k], "memory"
    text = _read_disk(k)
    if text is not None:
        _remember(k, text)
        return text, "disk"
    return None, "miss"


def put(k: str, text: str) -> None:
    _remember(k, text)
    _write_disk(k, text)


def _remember(k: str, text: str) -> None:
    with _LOCK:
        _MEMORY[k] = text
        _MEMORY.move_to_end(k)
        while len(_MEMORY) > MEMORY_ENTRIES:
            _MEMORY.popitem(last=False)


def _entry(k: str) -> Path | None:
    d = SETTINGS.directory()
    return None if d is None else d / k[:2] / f"{k}.s"


def _read_disk(k: str) -> str | None:
    path = _entry(k)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, _, rest = data.partition(b"\n")
    digest, _, payload = rest.partition(b"\n")
    if head + b"\n" != MAGIC or hashlib.sha256(payload).hexdigest().encode() != digest:
        log.warning("jitbyoc: ignoring corrupt cache entry %s", path)
        return None
    try:
        os.utime(path)  # least recently *used*: a hit refreshes the entry
        return payload.decode()
    except (OSError, UnicodeDecodeError):
        return None


def _write_disk(k: str, text: str) -> None:
    path = _entry(k)
    if path is None:
        return
    payload = text.encode()
    data = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # created 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("jitbyoc: cache write failed (%s); continuing without it", err)
        return
    root = path.parent.parent
    with _LOCK:
        estimate = _SIZES.get(root)
        if estimate is not None and estimate + len(data) <= SETTINGS.max_bytes:
            _SIZES[root] = estimate + len(data)
            return
    _evict(root)


_SIZES: dict[Path, int] = {}  # cache root -> bytes on disk (estimate; see the module doc)


def _evict(root: Path) -> None:
    """Scan ``root``, evict least recently used entries past the bound, note the size."""
    entries = []
    for p in root.glob("*/*.s"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= SETTINGS.max_bytes:
            break
        try:
            p.unlink()
            total -= size
        except OSError:
            pass
    with _LOCK:
        _SIZES[root] = total


def disk_usage() -> int:
    d = SETTINGS.directory()
    return 0 if d is None else sum(p.stat().st_size for p in d.glob("*/*.s"))

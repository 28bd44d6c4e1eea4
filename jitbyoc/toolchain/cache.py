"""The compile cache: a region's assembly, in memory and on disk, keyed by its content.

A key (:func:`key`) is the full text it covers: the caller's material (a region's
canonical content), the jitbyoc version plus a digest of jitbyoc's own source, TVM's
version, and the host (triple, CPU, features, LLVM and llvmlite versions). Its SHA-256
names the entry; every hit, in memory or on disk, compares the stored key text with the
asked one, so a collision, a moved or a swapped entry is a miss, never another region's
code. On disk each entry is one file written atomically (temp file + ``os.replace``;
the temp file is removed on any failure); it holds the key text and the payload under a
SHA-256 of both, so a corrupt or truncated entry is detected, ignored and rewritten.

The disk cache runs code it reads, so, like ssh and pip, it trusts a directory only if
this user owns it and nobody else can write it (the root, its two-hex-digit
subdirectories, and the directories above it: owned by root or this user, not writable
by others unless sticky like ``/tmp``); the root may be a symbolic link this user owns.
Missing directories are created mode 0700. An entry is read only if it is a regular file
this user owns and only it can write, opened without following links or blocking. A
directory that fails is reported once per process and the build continues without it.

The directory is bounded: least recently used entries (by modification time, refreshed on
every hit) are evicted past ``max_bytes``; only jitbyoc's own entries (``<2 hex>/<64
hex>.s`` regular files of this user starting with jitbyoc's magic) are counted or ever
deleted. It is scanned only when this process's running estimate of its size (the last
scan plus what the process wrote since) passes the bound (a scan of a full cache, ~8,000
entries, takes ~50 ms).

Location: ``$JITBYOC_CACHE_DIR``, else ``$XDG_CACHE_HOME/jitbyoc``, else
``~/.cache/jitbyoc``. ``JITBYOC_CACHE=0`` disables the disk cache; so does
``jitbyoc.toolchain.cache.configure(enabled=False)``, which can also move it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
from contextlib import suppress
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import tvm

from ..context import env_number
from ..memo import LRU
from ..version import __version__
from . import jit

log = logging.getLogger("jitbyoc")

MAGIC = b"jitbyoc-cache-v2\n"
OWN_PREFIX = b"jitbyoc-cache-v"  # entries of any format version are jitbyoc's to evict
MAX_ENTRY_BYTES = 256 << 20
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
    | getattr(os, "O_CLOEXEC", 0)
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_NAME = re.compile(r"[0-9a-f]{64}\.s")
_LOCK = threading.Lock()
_WARNED: set[str] = set()  # directories refused (and reported) by this process
# Bounded in count and in bytes: the disk cache serves the rest in well under a
# millisecond an entry, and a process that builds many models must not grow with them.
MEMORY_ENTRIES = 128
MEMORY_BYTES = 16 << 20
_MEMORY = LRU(MEMORY_ENTRIES, MEMORY_BYTES, lambda kv: len(kv[0]) + len(kv[1]))  # digest -> (key, payload)


class _Settings:
    def __init__(self):
        self.path: Path | None = None
        self.enabled: bool | None = None
        self.max_bytes = env_number("JITBYOC_CACHE_MAX_BYTES", 256 << 20)

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
    _MEMORY.clear()


PACKAGE = Path(__file__).resolve().parents[1]  # jitbyoc/, every subpackage included


def source_files() -> list[Path]:
    """Every source file of the jitbyoc package: what :func:`code_version` digests."""
    return sorted(PACKAGE.rglob("*.py"))


@lru_cache(maxsize=None)
def code_version() -> str:
    """jitbyoc's version and a digest of its source: editing jitbyoc invalidates the cache."""
    root = PACKAGE
    h = hashlib.sha256(__version__.encode())
    for p in source_files():
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return f"{__version__}+{h.hexdigest()[:16]}"


def _environment() -> str:
    """The code's and compilers' versions and the build's machine (:func:`jit.machine_info`)."""
    return _environment_of(tuple(sorted(jit.machine_info().items())))


@lru_cache(maxsize=None)
def _environment_of(machine: tuple) -> str:
    return json.dumps({"jitbyoc": code_version(), "tvm": tvm.__version__, **dict(machine)}, sort_keys=True)


@dataclass(frozen=True, order=True)
class Key:
    """What an entry is for: ``text`` is everything the key covers (compared on every
    hit), ``digest`` its SHA-256 (hex), which names the entry."""
    text: str = field(repr=False)
    digest: str


def key(material: str) -> Key:
    """The key of ``material`` (e.g. a region's canonical text) in this environment."""
    text = f"{material}\n{_environment()}"
    return Key(text, hashlib.sha256(text.encode()).hexdigest())


def get(k: Key) -> tuple[str | None, str]:
    """(assembly, where it came from: "memory", "disk" or "miss")."""
    hit = _MEMORY.get(k.digest)
    if hit is not None and hit[0] == k.text:
        return hit[1], "memory"
    text = _read_disk(k)
    if text is not None:
        _MEMORY.put(k.digest, (k.text, text))
        return text, "disk"
    return None, "miss"


def put(k: Key, text: str) -> None:
    _MEMORY.put(k.digest, (k.text, text))
    _write_disk(k, text)


# ---- trust: whose directories and files these are ---------------------------------------

def _problem(st: os.stat_result, directory: bool) -> str | None:
    """Why a directory or entry with status ``st`` is not this user's alone (None: it is)."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(st.st_mode):
        return "it is not a directory" if directory else "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _above_problem(path: str) -> str | None:
    """Why a directory above ``path`` (as written, and resolved) lets another user replace
    it: it must be owned by root or this user and not writable by others unless sticky."""
    written = os.path.dirname(path)
    for d in dict.fromkeys((written, os.path.realpath(written))):
        while True:
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                st = None
            if st is not None and st.st_uid not in (0, os.geteuid()):
                return f"{d} is owned by uid {st.st_uid}"
            if st is not None and not stat.S_ISLNK(st.st_mode) and not st.st_mode & stat.S_ISVTX \
                    and (st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid())):
                return f"{d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
            if d == os.path.dirname(d):
                break
            d = os.path.dirname(d)
    return None


def _root_problem(root: Path) -> str | None:
    """Why the cache root is not this user's alone: checks it, each symbolic link leading
    to it (this user's only) and the directories above each of them."""
    path = os.path.abspath(root)
    for _ in range(40):
        problem = _above_problem(path)
        st = os.lstat(path)
        if problem or not stat.S_ISLNK(st.st_mode):
            return problem or _problem(st, directory=True)
        if st.st_uid != os.geteuid():
            return f"{path} is a symbolic link owned by uid {st.st_uid}"
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return "too many symbolic links"


def _refuse(path: Path, problem: str) -> None:
    with _LOCK:
        if str(path) in _WARNED:
            return
        _WARNED.add(str(path))
    log.warning("jitbyoc: not using the disk cache directory %s: %s (it must be owned by uid %d "
                "and writable only by it); continuing without it", path, problem, os.geteuid())


def _make_dirs(path: Path) -> None:
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        with suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _trusted(path: Path, create: bool, check) -> bool:
    """Whether the directory ``path`` exists (made if ``create``) and ``check`` passes;
    a directory that fails is reported once."""
    try:
        if create:
            _make_dirs(path)
        problem = check(path)
    except FileNotFoundError as err:
        if not create:
            return False
        problem = f"it cannot be created ({err})"
    except OSError as err:
        problem = f"it cannot be created or inspected ({err})"
    if problem:
        _refuse(path, problem)
    return problem is None


def _subdir(k: Key, create: bool) -> Path | None:
    """The trusted subdirectory of ``k``'s entry; None if there is none."""
    root = SETTINGS.directory()
    if root is None or not _trusted(root, create, _root_problem):
        return None
    sub = root / k.digest[:2]
    ok = _trusted(sub, create, lambda p: _problem(os.lstat(p), directory=True))
    return sub if ok else None


# ---- entries -------------------------------------------------------------------------------

def _checksum(key_bytes: bytes, payload: bytes) -> bytes:
    h = hashlib.sha256(len(key_bytes).to_bytes(8, "big"))
    h.update(key_bytes)
    h.update(payload)
    return h.hexdigest().encode()


def _encode(k: Key, text: str) -> bytes:
    key_bytes, payload = k.text.encode(), text.encode()
    return b"".join([MAGIC, _checksum(key_bytes, payload), b"\n%d\n" % len(key_bytes), key_bytes, payload])


def _decode(data: bytes, k: Key, path: Path) -> str | None:
    """The payload of entry ``data`` if it is intact and ``k``'s (else None, reported)."""
    if data.startswith(MAGIC):
        digest, _, rest = data[len(MAGIC):].partition(b"\n")
        size, _, rest = rest.partition(b"\n")
        n = int(size) if size.isdigit() and len(size) < 12 else -1
        if 0 <= n <= len(rest) and _checksum(rest[:n], rest[n:]) == digest:
            if rest[:n] == k.text.encode():
                with suppress(UnicodeDecodeError):
                    return rest[n:].decode()
            else:
                log.warning("jitbyoc: ignoring cache entry %s: it is another key's (moved or swapped)",
                            path)
                return None
    log.warning("jitbyoc: ignoring corrupt cache entry %s", path)
    return None


def _read_entry(path: Path) -> bytes:
    """The bytes of the entry at ``path``: a regular file only this user can write, opened
    without following a link or blocking (ValueError says why it is refused)."""
    problem = _problem(os.lstat(path), directory=False)  # never open a FIFO or a device
    if problem:
        raise ValueError(problem)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        problem = _problem(st, directory=False)
        if problem or st.st_size > MAX_ENTRY_BYTES:
            raise ValueError(problem or f"it is larger than {MAX_ENTRY_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(st.st_size + 1)  # more than it had (it grew): the checksum fails
        os.utime(fd)  # least recently *used*: a hit refreshes the entry
        return data
    finally:
        os.close(fd)


def _read_disk(k: Key) -> str | None:
    sub = _subdir(k, create=False)
    if sub is None:
        return None
    path = sub / f"{k.digest}.s"
    try:
        data = _read_entry(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("jitbyoc: ignoring cache entry %s: %s", path, err)
        return None
    return _decode(data, k, path)


def _write_atomic(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` through a temporary file (0600), removed on any failure."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as err:
        log.warning("jitbyoc: cache write failed (%s); continuing without it", err)
        return False
    finally:
        if tmp is not None:
            with suppress(OSError):
                os.unlink(tmp)


def _write_disk(k: Key, text: str) -> None:
    sub = _subdir(k, create=True)
    if sub is None:
        return
    data = _encode(k, text)
    if not _write_atomic(sub / f"{k.digest}.s", data):
        return
    root = sub.parent
    with _LOCK:
        estimate = _SIZES.get(root)
        if estimate is not None and estimate + len(data) <= SETTINGS.max_bytes:
            _SIZES[root] = estimate + len(data)
            return
    _evict(root)


# ---- size bound ----------------------------------------------------------------------------

_SIZES: dict[Path, int] = {}  # cache root -> bytes on disk (estimate; see the module doc)


def _listing(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _lstat(entry: os.DirEntry) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except OSError:
        return None


def _own_entries(root: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of what may be jitbyoc's entries under ``root``: regular files of
    this user named ``<64 hex>.s`` in its subdirectory ``<first 2 hex>`` (links never followed)."""
    out = []
    for sub in _listing(root):
        st = _lstat(sub) if _SUBDIR.fullmatch(sub.name) else None
        if st is None or _problem(st, directory=True):
            continue
        for f in _listing(sub.path):
            st = _lstat(f) if _NAME.fullmatch(f.name) and f.name.startswith(sub.name) else None
            if st is not None and _problem(st, directory=False) is None:
                out.append((st.st_mtime, st.st_size, Path(f.path)))
    return out


def _is_own(path: Path) -> bool:
    """Whether ``path`` (a link is not followed) is a file of this user in jitbyoc's format."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return False
    try:
        return _problem(os.fstat(fd), directory=False) is None and \
            os.read(fd, len(OWN_PREFIX)) == OWN_PREFIX
    except OSError:
        return False
    finally:
        os.close(fd)


def _evict(root: Path) -> None:
    """Scan ``root``, evict least recently used entries past the bound, note the size."""
    entries = _own_entries(root)
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= SETTINGS.max_bytes:
            break
        if not _is_own(p):
            total -= size  # not jitbyoc's: neither deleted nor counted
            continue
        with suppress(OSError):
            p.unlink()
            total -= size
    with _LOCK:
        _SIZES[root] = total


def disk_usage() -> int:
    """Bytes of jitbyoc's entries in the (trusted) cache directory."""
    d = SETTINGS.directory()
    if d is None or not _trusted(d, False, _root_problem):
        return 0
    return sum(size for _, size, p in _own_entries(d) if _is_own(p))

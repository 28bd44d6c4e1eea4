"""The disk cache runs the code it reads, so it trusts only what this user alone controls.

Directories others can write (or own, or reach through their symbolic link), entries
others can write or own, entries moved to another key's place, FIFOs where an entry
should be: each is a miss (the region is compiled again), never someone else's code, a
hang or a failed build. Eviction deletes only jitbyoc's entries; a failed write leaves
no temporary file behind.
"""

import errno
import hashlib
import logging
import os
import pathlib
import shutil
import stat
import subprocess
import threading

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import cache
from tests.conftest import build_model
from tests.test_cache import build_status, fresh_cache  # noqa: F401 (a fixture)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")


@pytest.fixture
def cache_at(tmp_path):
    """Point the cache at a path of the test's choosing (memory cleared); reset afterwards."""
    def use(path):
        cache.configure(path=path, enabled=True)
        cache.clear_memory()
    yield use
    use(tmp_path / "unused")


def entry(root, k):
    return root / k.digest[:2] / f"{k.digest}.s"


def stored(root, k, payload="planted code"):
    """``k``'s entry on disk holding ``payload`` (written by the cache), memory cleared."""
    cache.put(k, payload)
    cache.clear_memory()
    assert entry(root, k).is_file()
    return entry(root, k)


def warnings_about(caplog, path):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]


def test_key_holds_its_whole_text():
    k = cache.key("a region's canonical text")
    assert k.text.startswith("a region's canonical text\n")
    assert k.digest == hashlib.sha256(k.text.encode()).hexdigest()
    assert k == cache.key("a region's canonical text") != cache.key("another region")
    assert sorted([k, cache.key("b")]) and {k: 1}[cache.key("a region's canonical text")] == 1


def test_a_hit_compares_the_whole_key(fresh_cache):
    k = cache.key("the real key")
    cache.put(k, "code")
    impostor = cache.Key("another key, same digest", k.digest)
    assert cache.get(impostor) == (None, "miss")  # neither memory nor disk hands out k's code
    assert cache.get(k) == ("code", "memory")


# ---- directories ---------------------------------------------------------------------------

def _subdir(root, k):
    return entry(root, k).parent


@pytest.mark.parametrize("where, change", [
    ("root", 0o777), ("root", 0o1777), ("root", 0o770),
    ("subdirectory", 0o777), ("subdirectory", 0o1777), ("subdirectory", 0o720),
    pytest.param("root", "owner", marks=as_root), pytest.param("subdirectory", "owner", marks=as_root),
])
def test_directory_others_control_is_not_used(fresh_cache, caplog, where, change):
    k = cache.key(f"trust {where} {change}")
    stored(fresh_cache, k)
    path = fresh_cache if where == "root" else _subdir(fresh_cache, k)
    if change == "owner":
        os.chown(path, NOBODY, NOBODY)
    else:
        os.chmod(path, change)
    assert cache.get(k) == (None, "miss")
    cache.put(k, "fresh code")  # the memory cache still works; the disk is left alone
    assert cache.get(k) == ("fresh code", "memory")
    cache.clear_memory()
    assert cache.get(k) == (None, "miss")
    assert len(warnings_about(caplog, path)) == 1  # once per directory and process


@pytest.mark.parametrize("above, used", [(0o755, True), (0o777, False)])
def test_root_through_own_symlink(cache_at, tmp_path, above, used):
    """This user's link to a private directory is followed, unless others can replace
    the directory (here: the one above it is writable by all)."""
    (tmp_path / "above").mkdir()
    cache_at(tmp_path / "above" / "cache")
    k = cache.key("through a link")
    cache.put(k, "code")
    os.chmod(tmp_path / "above", above)
    (tmp_path / "link").symlink_to(tmp_path / "above" / "cache")
    cache_at(tmp_path / "link")
    assert cache.get(k) == (("code", "disk") if used else (None, "miss"))


@as_root
@pytest.mark.parametrize("where", ["root", "subdirectory"])
def test_symlink_another_user_owns_is_not_followed(fresh_cache, tmp_path, where):
    k = cache.key(f"through a foreign link to the {where}")
    stored(fresh_cache, k)
    real = fresh_cache if where == "root" else _subdir(fresh_cache, k)
    link = tmp_path / "link" if where == "root" else real
    if where == "subdirectory":
        real = real.rename(tmp_path / "moved")
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    cache.configure(path=link if where == "root" else fresh_cache)
    assert cache.get(k) == (None, "miss")


@pytest.mark.parametrize("mode, used", [(0o777, False), (0o1777, True)])
def test_directory_above_the_root_others_can_write(cache_at, tmp_path, mode, used):
    """Like ssh: a directory above the cache must not let others replace it, unless it
    is sticky (as /tmp is: only the owner can rename what is in it)."""
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", mode)
    cache_at(tmp_path / "shared" / "cache")
    k = cache.key(f"under a {mode:o} directory")
    cache.put(k, "code")
    cache.clear_memory()
    assert cache.get(k) == (("code", "disk") if used else (None, "miss"))


def test_missing_directories_are_made_private(cache_at, tmp_path):
    root = tmp_path / "a" / "b" / "cache"
    cache_at(root)
    old = os.umask(0)
    try:
        cache.put(cache.key("private directories"), "code")
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", root, *root.iterdir()):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


# ---- entries -------------------------------------------------------------------------------

def _damage(path, change, tmp_path):
    if change == "owner":
        os.chown(path, NOBODY, NOBODY)
    elif change == "symlink":
        path.rename(tmp_path / "elsewhere.s")
        path.symlink_to(tmp_path / "elsewhere.s")
    else:
        os.chmod(path, change)


@pytest.mark.parametrize("change", [0o660, 0o606, 0o666, "symlink", pytest.param("owner", marks=as_root)])
def test_entry_others_control_is_not_loaded_and_is_rewritten(fresh_cache, tmp_path, caplog, change):
    k = cache.key(f"entry {change}")
    path = stored(fresh_cache, k)
    _damage(path, change, tmp_path)
    assert cache.get(k) == (None, "miss")
    assert warnings_about(caplog, path)
    cache.put(k, "rebuilt code")
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    cache.clear_memory()
    assert cache.get(k) == ("rebuilt code", "disk")
    if change == "symlink":
        assert (tmp_path / "elsewhere.s").is_file()  # the link was replaced, not its target


def test_swapped_entries_are_misses_and_rewritten(fresh_cache, caplog):
    a, b = cache.key("region a"), cache.key("region b")
    pa, pb = stored(fresh_cache, a, "code of a"), stored(fresh_cache, b, "code of b")
    os.replace(pa, pa.with_name("swap"))
    os.replace(pb, pa)
    os.replace(pa.with_name("swap"), pb)
    assert cache.get(a) == (None, "miss") and cache.get(b) == (None, "miss")
    assert warnings_about(caplog, pa) and warnings_about(caplog, pb)
    cache.put(a, "code of a")
    cache.clear_memory()
    assert cache.get(a) == ("code of a", "disk")


def test_oversized_entry_is_not_read(fresh_cache, monkeypatch):
    k = cache.key("oversized")
    stored(fresh_cache, k, "x" * 1000)
    monkeypatch.setattr(cache, "MAX_ENTRY_BYTES", 999)
    assert cache.get(k) == (None, "miss")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_at_an_entry_does_not_hang(fresh_cache):
    k = cache.key("fifo")
    path = stored(fresh_cache, k)
    path.unlink()
    os.mkfifo(path, 0o600)
    result = []
    reader = threading.Thread(target=lambda: result.append(cache.get(k)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    try:
        assert not reader.is_alive(), "reading the cache blocked on a FIFO"
    finally:
        if reader.is_alive():  # unblock it: a writer opens and closes the FIFO
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(timeout=30)
    assert result == [(None, "miss")]
    cache.put(k, "code")
    cache.clear_memory()
    assert cache.get(k) == ("code", "disk")


# ---- eviction and usage --------------------------------------------------------------------

def _plant_foreign(root, tmp_path) -> dict:
    """Files jitbyoc did not write, in and under its directory: path -> content."""
    name = "ab" + "0" * 62 + ".s"
    (tmp_path / "outside.s").write_bytes(cache.MAGIC + b"outside the cache")
    files = {root / "foo.s": b"foo", root / "ab" / "notours.s": b"not ours",
             root / "ab" / name: b"a valid name, no magic",
             root / "cd" / name: cache.MAGIC + b"in the wrong subdirectory"}
    for path, data in files.items():
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, 0o600)
    link = root / "ab" / ("ab" + "1" * 62 + ".s")
    link.symlink_to(tmp_path / "outside.s")
    files[link] = files[tmp_path / "outside.s"] = cache.MAGIC + b"outside the cache"
    return files


def test_eviction_deletes_only_jitbyocs_entries(fresh_cache, tmp_path):
    ours = [stored(fresh_cache, cache.key(f"evict {i}"), "x" * 1000) for i in range(3)]
    foreign = _plant_foreign(fresh_cache, tmp_path)
    cache.configure(max_bytes=1)
    try:
        cache.put(cache.key("evict, past the bound"), "y")  # scans and evicts everything of ours
    finally:
        cache.configure(max_bytes=256 << 20)
    assert not any(p.exists() for p in ours)
    assert {p: p.read_bytes() for p in foreign} == foreign
    assert (fresh_cache / "ab" / ("ab" + "1" * 62 + ".s")).is_symlink()


def test_disk_usage_counts_only_jitbyocs_entries(fresh_cache, tmp_path):
    ours = [stored(fresh_cache, cache.key(f"usage {i}"), "x" * 1000) for i in range(3)]
    _plant_foreign(fresh_cache, tmp_path)
    assert cache.disk_usage() == sum(p.stat().st_size for p in ours)


# ---- failed writes -------------------------------------------------------------------------

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile:
    """A file object (from ``os.fdopen``) on a full disk: writes fail, closing works."""

    def __init__(self, f):
        self._f = f

    write = staticmethod(_no_space)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_failed_write_leaves_no_temporary_file(fresh_cache, monkeypatch, caplog):
    k = cache.key("no space left")
    fdopen = os.fdopen
    with monkeypatch.context() as m:
        m.setattr(os, "write", _no_space)
        m.setattr(os, "fdopen", lambda fd, *a, **kw: _FullFile(fdopen(fd, *a, **kw)))
        cache.put(k, "x" * 10000)
    assert not list(fresh_cache.rglob(".tmp-*"))
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert cache.get(k) == ("x" * 10000, "memory")
    cache.clear_memory()
    assert cache.get(k) == (None, "miss")


@as_root
@pytest.mark.skipif(shutil.which("mount") is None, reason="needs mount(8) for a small tmpfs")
def test_full_disk_leaves_no_temporary_file(cache_at, tmp_path):
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(small)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        cache_at(small / "cache")
        fits, too_big = cache.key("fits"), cache.key("does not fit")
        cache.put(fits, "f" * 1000)
        cache.put(too_big, "b" * (256 << 10))
        leftovers = list(small.rglob(".tmp-*"))
        cache.clear_memory()
        assert (cache.get(fits), cache.get(too_big)) == (("f" * 1000, "disk"), (None, "miss"))
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


# ---- a whole build -------------------------------------------------------------------------

def _add():
    return build_model({"x": ((4,), "float32"), "y": ((4,), "float32")},
                       lambda bb, x, y: bb.emit(relax.op.add(x, y)))


@pytest.mark.parametrize("change", [0o664, 0o646, pytest.param("owner", marks=as_root)])
def test_build_compiles_again_rather_than_load_entries_others_can_write(fresh_cache, change):
    _, status = build_status(_add())
    assert status == ["compiled"]
    written = sorted(fresh_cache.glob("*/*.s"))
    for path in written:
        os.chown(path, NOBODY, NOBODY) if change == "owner" else os.chmod(path, change)
    cache.clear_memory()
    ex, status = build_status(_add())
    assert status == ["compiled"]
    x, y = np.full(4, 5, "float32"), np.full(4, 3, "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))
    np.testing.assert_array_equal(out.numpy(), 8)
    for path in written:  # rewritten: this user's, private
        st = path.stat()
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600


def test_the_code_version_digests_every_source_file_of_the_package():
    """Editing any jitbyoc file (a renderer, a kernel) must invalidate the cache, not only
    the files next to cache.py."""
    package = pathlib.Path(jitbyoc.__file__).resolve().parent
    assert set(cache.source_files()) == set(package.rglob("*.py"))
    assert package / "render" / "llvm.py" in cache.source_files()

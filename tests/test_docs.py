"""The documentation's code runs, and its links lead somewhere.

Conventions for README.md and docs/*.md, enforced here:

* Every fenced code block names its language (```python, ```bash, ```text, ```llvm, ```c…).
  A fence without one fails, so an example cannot slip through unlabelled and unrun.
* Every ```python block runs: each in a fresh interpreter (``sys.executable``), in an empty
  temporary directory, within ``TIMEOUT_S`` seconds, with jitbyoc's disk cache in a
  temporary directory and this checkout first on ``PYTHONPATH``. It passes when it exits
  with status 0. Keep examples tiny: small shapes, no downloads, a few seconds each
  (importing TVM alone takes about 4 s).
* A python block that must not run carries a marker on the line directly before its
  opening fence, with a reason:

      <!-- not run: needs a C compiler to link -->

  An empty reason fails, and so does a marker that is not directly followed by a python
  fence.
* Blocks of any other language (bash, text, console, llvm, c…) are shown, never run.
* Every relative link, ``[text](path)``, ``[text](path#anchor)`` or ``[text](#anchor)``
  (images and reference definitions too), must lead to a file in this repository, and an
  anchor into a markdown file must be one of its headings, slugged as GitHub does.
  Links with a scheme (``https:``, ``mailto:``) are not checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 90  # per block; a block should take a few seconds, this is only the guard
WORKERS = max(1, min(2, os.cpu_count() or 1))  # blocks run two at a time
README_MAX_LINES = 250

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*not run\s*:(?P<reason>.*?)-->\s*$")
MARKER_START = re.compile(r"^\s*<!--\s*not run\b")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(?P<text>.*?)(?:[ \t]+#+)?[ \t]*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$", re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the marker's reason; None: the block runs

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass
class Doc:
    path: Path
    blocks: list[Block]
    prose: str  # the text with every fenced block blanked out (line numbers kept)
    problems: list[str]


def parse(path: Path) -> Doc:
    """Split a markdown file into its fenced blocks and its prose."""
    lines = path.read_text(encoding="utf-8").split("\n")
    rel = path.relative_to(ROOT)
    blocks, problems, prose = [], [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        start, fence, indent = i, m["fence"], len(m["indent"])
        lang = m["info"].strip().split()[0].lower() if m["info"].strip() else ""
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, i = [], i + 1
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        if i == len(lines):
            problems.append(f"{rel}:{start + 1}: the fence opened here is never closed")
        if not lang:
            problems.append(f"{rel}:{start + 1}: a fenced block without a language (```python, ```text…)")
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        reason = marker["reason"].strip() if marker else None
        if marker and not reason:
            problems.append(f"{rel}:{start}: a 'not run' marker needs a reason: <!-- not run: why -->")
        if marker and lang != "python":
            problems.append(f"{rel}:{start}: a 'not run' marker before a {lang or 'unlabelled'} block "
                            f"(only python blocks run)")
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", reason))
        prose.extend([""] * (i + 1 - start))  # the block's lines, blanked
        i += 1
    for n, text in enumerate(lines):
        if MARKER_START.match(text) and not MARKER.match(text):
            problems.append(f"{rel}:{n + 1}: a malformed marker (write <!-- not run: why -->)")
        elif MARKER.match(text) and not (n + 1 < len(lines) and FENCE.match(lines[n + 1])):
            problems.append(f"{rel}:{n + 1}: a 'not run' marker must be directly followed by a python fence")
    return Doc(path, blocks, "\n".join(prose[:len(lines)]), problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, without punctuation
    but hyphens and underscores, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in doc.prose.split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m["text"])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(doc: Doc) -> list[tuple[int, str]]:
    """(line, target) of every link in the prose, code spans left out."""
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), doc.prose)
    found = [(m.start(), m["target"]) for m in LINK.finditer(text)]
    found += [(m.start(), m["target"]) for m in REFERENCE.finditer(text)]
    return sorted((text.count("\n", 0, at) + 1, target) for at, target in found)


PARSED = {p: parse(p) for p in DOCS if p.exists()}
BLOCKS = [b for d in PARSED.values() for b in d.blocks]
RUNNABLE = [b for b in BLOCKS if b.lang == "python" and b.not_run is None]


def broken_link(doc: Doc, target: str) -> str | None:
    """Why ``target``, a link in ``doc``, leads nowhere (None: it resolves)."""
    if not target:
        return "an empty link"
    if SCHEME.match(target) or target.startswith("//"):
        return None  # https:, mailto:: not checked
    part, _, anchor = target.partition("#")
    dest = (doc.path.parent / unquote(part)).resolve() if part else doc.path
    if ROOT not in dest.parents and dest != ROOT:
        return f"{part} is outside the repository"
    if not dest.exists():
        return f"{part}: no such file"
    if anchor and dest.suffix == ".md":
        other = PARSED.get(dest) or parse(dest)
        if anchor not in anchors(other):
            return f"#{anchor}: no such heading in {dest.relative_to(ROOT)}"
    return None


# ---- the documentation's shape ---------------------------------------------------------

def test_the_docs_are_there_and_hold_examples():
    assert (ROOT / "README.md") in PARSED, "README.md is missing"
    assert len(PARSED) > 1, "no docs/*.md found"
    assert RUNNABLE, "no python block to run: the examples would go unchecked"


@pytest.mark.parametrize("path", list(PARSED), ids=lambda p: str(p.relative_to(ROOT)))
def test_fences_and_markers_are_well_formed(path):
    problems = PARSED[path].problems
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", list(PARSED), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    doc = PARSED[path]
    bad = [f"{path.relative_to(ROOT)}:{line}: ({target}) {why}"
           for line, target in links(doc) if (why := broken_link(doc, target))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_opens_with_the_ci_command_and_stays_short():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")][-1]
    readme = PARSED[ROOT / "README.md"]
    first = readme.blocks[0]
    assert first.lang == "bash" and first.line <= 6, "README.md must open with the set-up commands"
    assert ci in first.code.splitlines(), f"README.md's set-up block must hold .ci/run's command:\n{ci}"
    n = len(readme.path.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/ (at most {README_MAX_LINES})"


# ---- the examples run ------------------------------------------------------------------

@dataclass
class Ran:
    returncode: int | None  # None: timed out
    stdout: str
    stderr: str
    seconds: float


def _run(block: Block, workdir: Path, env: dict) -> Ran:
    workdir.mkdir(parents=True)
    script = workdir / "example.py"
    script.write_text(block.code, encoding="utf-8")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
        return Ran(p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        errs = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        return Ran(None, out, errs, time.perf_counter() - t0)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected python block, started at once, ``WORKERS`` at a time."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "callspec", None) is not None and "block" in item.callspec.params]
    base = tmp_path_factory.mktemp("doc-examples")
    env = dict(os.environ, JITBYOC_CACHE_DIR=str(base / "jitbyoc-cache"), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    futures = {b: pool.submit(_run, b, base / f"block{k}", env) for k, b in enumerate(selected)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_python_block_runs(block, runs):
    ran = runs[block].result()
    tail = lambda s: "\n".join(s.rstrip().splitlines()[-25:])  # noqa: E731
    if ran.returncode is None:
        pytest.fail(f"{block.where}: still running after {TIMEOUT_S} s (keep examples tiny)\n"
                    f"--- stderr ---\n{tail(ran.stderr)}")
    assert ran.returncode == 0, (f"{block.where} failed (exit {ran.returncode}, {ran.seconds:.1f} s)\n"
                                 f"--- stdout ---\n{tail(ran.stdout)}\n--- stderr ---\n{tail(ran.stderr)}")

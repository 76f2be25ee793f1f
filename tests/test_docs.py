"""The documentation resolves: every relative Markdown link names a file (and heading) that
exists, and every section reference ("docs/design.md" + section sign + "4.2", "BENCHMARKS"
+ section sign + "5") in Markdown, Python, shell and TOML files names a numbered heading
that exists. Nothing may point outside the repository.

Pure text checks (no jax). A failure lists `file:line: reference: why` for each broken one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "\u00a7"  # the section sign, spelled so this file holds no reference itself
SCANNED = (".md", ".py", ".sh", ".toml")
SKIP_DIRS = {"__pycache__", "node_modules", "build", "dist", "venv", "runs", "site-packages"}
# Text that points outside the repository (built by concatenation for the same reason).
OUTSIDE = ("../" + "shared", "shared/" + "DESIGN", "/" + "work/")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_SECTION_ID = re.compile(r"^(\d+[a-z]?(?:\.\d+)*)\.?(?:\s|$)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF = re.compile(SECTION + r"\s?(\d+[a-z]?(?:\.\d+)*)")
_DOC_BEFORE = re.compile(r"([\w./-]+\.md|\b[A-Z][A-Z_]{2,})\s*$")
_CHAIN_GAP = re.compile(r"^[\s,;#*\"]*(?:(?:and|or|&)[\s#*\"]*)?$")


def _walk(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and d not in SKIP_DIRS
            and not d.endswith(".egg-info")
            and not (Path(dirpath, d) / "pyvenv.cfg").exists()
        )
        for name in sorted(filenames):
            if name.endswith(SCANNED):
                yield Path(dirpath, name)


def _prose_lines(text: str):
    """(line number, line) of Markdown text outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces → hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> tuple[set[str], set[str]]:
    """(numbered section ids, anchors) of a Markdown file."""
    sections, anchors, seen = set(), set(), {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        title = m.group(2)
        sid = _SECTION_ID.match(title)
        if sid:
            sections.add(sid.group(1))
        a = slug(title)
        anchors.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return sections, anchors


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _resolve_doc(name: str, source: Path, root: Path) -> Path | None:
    """A document named in prose: a path relative to the root or the citing file, or an
    upper-case stem (`BENCHMARKS` → BENCHMARKS.md)."""
    if not name.endswith(".md"):
        name += ".md"
    for base in (root, source.parent):
        p = (base / name).resolve()
        if p.is_file() and p.is_relative_to(root.resolve()):
            return p
    return None


def link_problems(path: Path, root: Path) -> list[str]:
    out = []
    text = path.read_text(encoding="utf-8")
    for n, line in _prose_lines(text):
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, gs:
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{path.relative_to(root)}:{n}: link ({target})"
            if file_part.startswith("/"):
                out.append(f"{where}: absolute path, outside the repository")
                continue
            dest = (path.parent / file_part).resolve() if file_part else path.resolve()
            if not dest.is_relative_to(root.resolve()):
                out.append(f"{where}: points outside the repository")
            elif not dest.exists():
                out.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in headings(dest)[1]:
                out.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return out


def section_problems(path: Path, root: Path) -> list[str]:
    """Each section reference names a document (or, in Markdown, means its own file) and a
    numbered heading of it. A bare reference right after another (a list: "doc, sections 3,
    4.3 and 6") inherits that one's document; a list after an unknown document is reported
    once."""
    out = []
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":  # commands in fenced blocks are no references
        lines = text.splitlines()
        keep = dict(_prose_lines(text))
        text = "\n".join(keep.get(n, "") for n in range(1, len(lines) + 1))
    prev_end, prev_doc = -1, None
    for m in _REF.finditer(text):
        ref = m.group(0)
        before = text[max(prev_end, 0) : m.start()] if prev_end >= 0 else None
        named = _DOC_BEFORE.search(text[max(0, m.start() - 120) : m.start()])
        where = f"{path.relative_to(root)}:{_line_of(text, m.start())}"
        if named:
            doc_name = named.group(1)
            doc = _resolve_doc(doc_name, path, root)
            label = f"{doc_name} {ref}"
        elif before is not None and _CHAIN_GAP.match(before):
            prev_end = m.end()
            if prev_doc is None:  # the list's document is unknown: reported already
                continue
            doc, label = prev_doc, f"{prev_doc.relative_to(root.resolve())} {ref}"
            doc_name = str(prev_doc.name)
        elif path.suffix == ".md":
            doc, doc_name, label = path.resolve(), path.name, ref
        else:
            out.append(f"{where}: {ref}: names no document (write e.g. docs/design.md {ref})")
            prev_end, prev_doc = m.end(), None
            continue
        if doc is None:
            out.append(f"{where}: {label}: no document {doc_name} in the repository")
        elif m.group(1) not in headings(doc)[0]:
            out.append(f"{where}: {label}: no numbered heading {m.group(1)} in {doc.name}")
        prev_end, prev_doc = m.end(), doc
    return out


def outside_problems(path: Path, root: Path) -> list[str]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        bad = next((b for b in OUTSIDE if b in line), None)
        if bad is not None:
            out.append(f"{path.relative_to(root)}:{n}: {bad!r}: a path outside the repository")
    return out


def check(root: Path) -> list[str]:
    problems = []
    for path in _walk(root):
        if path.suffix == ".md":
            problems += link_problems(path, root)
        problems += section_problems(path, root)
        problems += outside_problems(path, root)
    return problems


def test_repository_docs_resolve():
    problems = check(ROOT)
    assert not problems, "broken documentation references:\n" + "\n".join(problems)


def test_design_doc_exists_with_its_sections():
    sections, _ = headings(ROOT / "docs" / "design.md")
    for s in ("1", "2", "3", "4", "4.1", "4.2", "4.3", "5", "6", "7", "7b", "8"):
        assert s in sections, f"docs/design.md lost section {s}"


# ---- the checker itself, on a synthetic repository ------------------------------------------
@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        "# Design\n\n## 1. Overview\n\n### 4.2 Stage two\n\n### 7b. Compiles\n", encoding="utf-8"
    )
    (tmp_path / "BENCHMARKS.md").write_text("# B\n\n## 5. TPU\n", encoding="utf-8")
    return tmp_path


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def test_checker_accepts_good_references(fake_repo: Path):
    s = SECTION
    _write(
        fake_repo / "README.md",
        f"See [design](docs/design.md#1-overview), [b](BENCHMARKS.md), docs/design.md {s}1,\n"
        f"BENCHMARKS {s}5 and [web](https://example.com/x.md).\n\n```\n[x](missing.md) {s}9\n```\n",
    )
    _write(
        fake_repo / "pkg" / "mod.py",
        f'"""Stage 2 (docs/design.md {s}4.2, {s}7b\nand {s}1)."""\n# BENCHMARKS.md {s}5\n',
    )
    _write(
        fake_repo / "docs" / "other.md", f"# O\n\n## 3. Here\n\nSee {s}3 and [up](../README.md).\n"
    )
    assert check(fake_repo) == []


def test_checker_names_file_line_and_reference_of_each_broken_one(fake_repo: Path):
    s = SECTION
    _write(
        fake_repo / "README.md",
        "# R\n\n"
        "[gone](docs/missing.md)\n"  # line 3
        "[bad anchor](docs/design.md#no-such-heading)\n"  # line 4
        f"docs/design.md {s}9\n"  # line 5
        "[up](../elsewhere.md)\n",  # line 6
    )
    _write(
        fake_repo / "pkg" / "mod.py",
        f'"""Old style: DESIGN {s}2."""\n# bare {s}4.2\nx = "{OUTSIDE[0]}/DESIGN.md"\n',
    )
    problems = check(fake_repo)
    expected = [
        "README.md:3: link (docs/missing.md): no such file",
        "README.md:4: link (docs/design.md#no-such-heading): no heading with anchor",
        f"README.md:5: docs/design.md {s}9: no numbered heading 9 in design.md",
        "README.md:6: link (../elsewhere.md): points outside the repository",
        f"pkg/mod.py:1: DESIGN {s}2: no document DESIGN in the repository",
        f"pkg/mod.py:2: {s}4.2: names no document",
        f"pkg/mod.py:3: {OUTSIDE[0]!r}: a path outside the repository",
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for want in expected:
        assert any(p.startswith(want) for p in problems), f"{want!r} not in:\n" + "\n".join(
            problems
        )


def test_the_stack_wheels_the_suite_runs_are_the_ones_installed_and_documented():
    """README command (2) and `.ci/run` install the vLLM, SGLang and tpu-inference wheels at
    the versions `drafter/stacks.py` pins, and docs/serving.md names the same."""
    from adaflash_jax.drafter.stacks import SGLANG, TPU_INFERENCE, VLLM

    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    serving = (ROOT / "docs" / "serving.md").read_text()
    for pin in (f"vllm=={VLLM}", f"sglang=={SGLANG}", f"tpu-inference=={TPU_INFERENCE}"):
        assert pin in readme and pin in ci and pin in serving, pin

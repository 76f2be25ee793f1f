"""Offline text sources present in every Python install: the standard library itself.

Code comes from stdlib `.py` files (one document per function or method, verbatim); prose
from the docstrings of a DISJOINT set of stdlib files, the language reference topics shipped
in `pydoc_data`, and `LICENSE.txt`. Keeping the two file sets disjoint means a docstring that
sits inside a held-out code document never reappears as a training prose document.

Documents carry no trailing newline: EOS follows the last character directly. Otherwise
"\n" -> EOS becomes one of the commonest bigrams and a small model ends answers early.

Everything here is deterministic for a given Python installation; provenance (paths and
byte counts) is returned with the documents so the corpus metadata can record it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import os
import sysconfig
import textwrap

# Directories skipped: tests, GUI/demo code, vendored or generated trees, and packages that
# some distributions split out of the base install (idlelib, tkinter, lib2to3, ensurepip).
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "site-packages",
        "dist-packages",
        "ensurepip",
        "distutils",
        "__pycache__",
        "lib-dynload",
        "encodings",
        "pydoc_data",
    }
)
_MIN_FILE_BYTES, _MAX_FILE_BYTES = 2_000, 250_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawDoc:
    """One source document before splitting. `key` is stable across machines and slices."""

    key: str
    text: str
    prompt: str  # a prefix of `text` that makes a natural generation prompt ("" if none)
    title: str = ""  # short human name (function name, topic), used by the dialogue domain
    summary: str = ""  # one-paragraph description, used by the dialogue domain


def stable_hash(*parts: str) -> int:
    """64-bit hash of strings, identical on every machine and Python run (unlike hash())."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def stdlib_dir() -> str:
    path = sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"the Python standard library directory {path} does not exist")
    return path


def stdlib_python_files(root: str) -> list[str]:
    """Sorted relative paths of candidate stdlib modules (size-filtered, skipping _SKIP_DIRS)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            full = os.path.join(dirpath, name)
            if _MIN_FILE_BYTES <= os.path.getsize(full) <= _MAX_FILE_BYTES:
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


def file_role(relpath: str) -> str:
    """Each stdlib file feeds exactly one domain: 'code' or 'prose' (docstrings)."""
    return "code" if stable_hash("file-role", relpath) % 2 == 0 else "prose"


def select_files(root: str, role: str, byte_budget: int) -> list[tuple[str, int]]:
    """Files of one role in a stable hashed order, until the byte budget is used."""
    files = [p for p in stdlib_python_files(root) if file_role(p) == role]
    files.sort(key=lambda p: stable_hash("file-order", p))
    chosen, used = [], 0
    for rel in files:
        if used >= byte_budget:
            break
        size = os.path.getsize(os.path.join(root, rel))
        chosen.append((rel, size))
        used += size
    return sorted(chosen)


def _read_module(root: str, rel: str) -> tuple[str, ast.Module] | None:
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            source = f.read()
        return source, ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _functions(tree: ast.Module):
    """(qualname, node): top-level functions and the methods of top-level classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{sub.name}", sub


def _first_paragraph(text: str) -> str:
    return text.strip().split("\n\n", 1)[0].strip()


def code_documents(root: str, files: list[str], max_chars: int = 6000) -> list[RawDoc]:
    """One document per function/method, verbatim source (dedented methods)."""
    docs = []
    for rel in files:
        parsed = _read_module(root, rel)
        if parsed is None:
            continue
        lines = parsed[0].splitlines()
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        for qualname, node in _functions(parsed[1]):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            block = lines[start : node.end_lineno]
            docstring = ast.get_docstring(node)
            first = node.body[0]
            has_doc = docstring is not None and len(node.body) > 1
            # The prompt ends after the docstring (or, without one, after the signature).
            cut = (first.end_lineno if has_doc else first.lineno - 1) - start
            text = textwrap.dedent("\n".join(block))
            if not 80 <= len(text) <= max_chars:
                continue
            # No trailing newline: in the document it merges with the next line's indent into
            # one whitespace token, so a prompt ending in a lone "\n" would be out of
            # distribution (the model has mostly seen "\n" right before EOS).
            prompt = "".join(text.splitlines(keepends=True)[:cut]).removesuffix("\n")
            docs.append(
                RawDoc(
                    key=f"{rel}:{qualname}",
                    text=text,
                    prompt=prompt if has_doc else "",
                    title=f"{module}.{qualname}",
                    summary=_first_paragraph(docstring) if has_doc else "",
                )
            )
    return docs


def _opening_sentence(text: str) -> str:
    """The text up to and including the first sentence end, or "" when there is none."""
    for i, ch in enumerate(text):
        if i > 300:
            break
        if ch in ".?!:" and i >= 20 and (i + 1 == len(text) or text[i + 1] in " \n"):
            return text[: i + 1]
    return ""


def _prose_doc(key: str, text: str, title: str) -> RawDoc | None:
    text = text.strip()
    if len(text) < 200:
        return None
    opening = _opening_sentence(text)
    prompt = opening if opening and len(text) - len(opening) >= 80 else ""
    return RawDoc(key=key, text=text, prompt=prompt, title=title, summary=_first_paragraph(text))


def _paragraph_chunks(text: str, max_chars: int) -> list[str]:
    chunks, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) > max_chars:
            chunks.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        chunks.append(current)
    return chunks


def docstring_documents(root: str, files: list[str]) -> list[RawDoc]:
    """Module, class and function docstrings of the prose-role files."""
    docs = []
    for rel in files:
        parsed = _read_module(root, rel)
        if parsed is None:
            continue
        tree = parsed[1]
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        nodes = [(module, tree)]
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                nodes.append((f"{module}.{node.name}", node))
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        nodes.append((f"{module}.{node.name}.{sub.name}", sub))
        for name, node in nodes:
            doc = ast.get_docstring(node)
            made = doc and _prose_doc(f"{rel}:{name}", inspect.cleandoc(doc), name)
            if made:
                docs.append(made)
    return docs


def reference_documents(root: str, max_chars: int = 2000) -> tuple[list[RawDoc], list[dict]]:
    """The language reference topics of `pydoc_data` and the LICENSE text, in chunks."""
    docs, provenance = [], []
    topics_path = os.path.join(root, "pydoc_data", "topics.py")
    if os.path.isfile(topics_path):
        with open(topics_path, encoding="utf-8") as f:
            source = f.read()
        topics = ast.literal_eval(source.split("=", 1)[1].strip())
        provenance.append({"path": "pydoc_data/topics.py", "bytes": len(source.encode())})
        for topic in sorted(topics):
            for i, chunk in enumerate(_paragraph_chunks(topics[topic], max_chars)):
                made = _prose_doc(f"pydoc_data/topics.py:{topic}:{i}", chunk, topic)
                if made:
                    docs.append(made)
    license_path = os.path.join(root, "LICENSE.txt")
    if os.path.isfile(license_path):
        with open(license_path, encoding="utf-8") as f:
            text = f.read()
        provenance.append({"path": "LICENSE.txt", "bytes": len(text.encode())})
        for i, chunk in enumerate(_paragraph_chunks(text, max_chars)):
            made = _prose_doc(f"LICENSE.txt:{i}", chunk, "the Python license")
            if made:
                docs.append(made)
    return docs, provenance

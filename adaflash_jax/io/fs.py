"""Run-directory files on local disks and on `gs://` (Cloud TPU runs), through fsspec.

`gs://` goes to gcsfs (a declared dependency); any other fsspec URL works too (tests use
`memory://`). Local writes are atomic (a sibling temporary file, then a rename); an object
store replaces whole objects anyway. A remote write that fails (an `OSError`: a dropped
connection, a 5xx the client gave up on) is retried `WRITE_ATTEMPTS` times with doubling
pauses; one that keeps failing raises `StorageError`, one line naming the path, and leaves
the object as it was. Orbax checkpoints take the same URLs on their own (and their own
retries).
"""

from __future__ import annotations

import io
import os
import posixpath
import time

import fsspec
import numpy as np


def is_remote(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


def absolute(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return path.rstrip("/") if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def join(path: str, *names: str) -> str:
    return "/".join([os.fspath(path).rstrip("/"), *names])


def _fs(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(os.fspath(path))


def exists(path: str) -> bool:
    fs, p = _fs(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    fs, p = _fs(path)
    return fs.isdir(p)


def listdir(path: str) -> list[str]:
    """Names (not paths) of the entries of a directory."""
    fs, p = _fs(path)
    return sorted(os.path.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))


def makedirs(path: str) -> None:
    fs, p = _fs(path)
    fs.makedirs(p, exist_ok=True)


def remove(path: str) -> None:
    """Deletes a file when it exists."""
    fs, p = _fs(path)
    if fs.exists(p):
        fs.rm(p)


WRITE_ATTEMPTS = 4
FIRST_PAUSE_S = 1.0  # then 2, 4: about 7 s before giving up


class StorageError(OSError):
    """A remote write that kept failing."""


def write_bytes(path: str, data: bytes) -> None:
    """A whole file, never seen half-written: local files go through a rename, remote ones
    are one object write, retried (module docstring)."""
    fs, p = _fs(path)
    if is_remote(path):
        for attempt in range(WRITE_ATTEMPTS):
            try:
                fs.makedirs(posixpath.dirname(p), exist_ok=True)
                fs.pipe_file(p, data)
                return
            except OSError as e:
                if attempt == WRITE_ATTEMPTS - 1:
                    raise StorageError(
                        f"writing {path} failed {WRITE_ATTEMPTS} times, the last with "
                        f"{type(e).__name__}: {e}"
                    ) from None
                time.sleep(FIRST_PAUSE_S * 2**attempt)
    fs.makedirs(posixpath.dirname(p), exist_ok=True)
    tmp = f"{p}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, p)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def read_bytes(path: str) -> bytes:
    fs, p = _fs(path)
    return fs.cat_file(p)


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def save_npz(path: str, **arrays) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes(path, buf.getvalue())


def load_npz(path: str) -> dict:
    with np.load(io.BytesIO(read_bytes(path))) as z:
        return {k: z[k] for k in z.files}

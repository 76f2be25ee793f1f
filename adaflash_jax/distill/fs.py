"""Run-directory file access that works on local paths and on `gs://` (Cloud TPU runs).

Everything goes through `etils.epath` (installed with orbax), which handles both; remote
paths additionally need its GCS backend (gcsfs or tensorflow) on the workers.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile

from etils import epath


def is_remote(path: str) -> bool:
    return "://" in str(path)


def absolute(path: str) -> str:
    return str(path) if is_remote(path) else os.path.abspath(os.path.expanduser(str(path)))


def exists(path: str) -> bool:
    return epath.Path(path).exists()


def makedirs(path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def write_bytes(path: str, data: bytes) -> None:
    """Written to a sibling temporary name, then renamed (atomic on local disks)."""
    p = epath.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(path):  # object stores replace whole objects anyway
        p.write_bytes(data)
        return
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def read_bytes(path: str) -> bytes:
    return epath.Path(path).read_bytes()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def save_npz(path: str, **arrays) -> None:
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes(path, buf.getvalue())


def load_npz(path: str) -> dict:
    import numpy as np

    with np.load(io.BytesIO(read_bytes(path))) as z:
        return {k: z[k] for k in z.files}


def copy_tree(src: str, dst: str) -> None:
    """Copies a local directory's files to `dst` (local or remote)."""
    for root, _, files in os.walk(src):
        rel = os.path.relpath(root, src)
        target = epath.Path(dst) if rel == "." else epath.Path(dst) / rel
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                (target / name).write_bytes(f.read())


class LocalDir:
    """A local directory standing in for `path`: itself when local, else a temporary one whose
    files are copied to `path` by `sync()` (and on exit)."""

    def __init__(self, path: str):
        self.path = path
        self.local = path if not is_remote(path) else tempfile.mkdtemp(prefix="adaflash_")

    def sync(self) -> None:
        if self.local != self.path:
            copy_tree(self.local, self.path)

    def __enter__(self):
        os.makedirs(self.local, exist_ok=True)
        return self.local

    def __exit__(self, *exc):
        self.sync()
        if self.local != self.path:
            shutil.rmtree(self.local, ignore_errors=True)

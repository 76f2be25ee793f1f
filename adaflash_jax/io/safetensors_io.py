"""Minimal safetensors reader/writer over numpy memory maps.

Reading through `np.memmap` lets a loader slice one device's shard of a tensor without
reading (or holding) the rest, and it handles bf16 through `ml_dtypes`, which the
`safetensors` numpy backend does not.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, malformed or uses an unknown dtype."""


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """Returns (tensor table, byte offset of the data section)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds file size {size}")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} runs past the end of the file")
    return header, data_start


class SafetensorsFile:
    """Lazy, memory-mapped view of one .safetensors file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.header, self._data_start = read_header(self.path)

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self.header[name]["dtype"]]

    def get(self, name: str) -> np.ndarray:
        """A read-only memory map of the tensor; slicing it reads only the slice."""
        info = self.header[name]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        dtype = DTYPES[info["dtype"]]
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has inconsistent byte size")
        if not shape or 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(
            self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape
        )


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes tensors atomically (temp file + rename), so a crash never leaves a torn file."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        arr = np.ascontiguousarray(np.asarray(tensors[name]))
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r} has unsupported dtype {arr.dtype}")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays[name] = arr
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
    os.replace(tmp, path)

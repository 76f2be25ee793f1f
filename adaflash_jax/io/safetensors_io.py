"""safetensors files through the `safetensors` library (numpy API; bf16 via ml_dtypes).

Reading memory-maps the file (`safe_open`) and hands out lazy `TensorView`s: indexing one
reads only that slice (`get_slice`), so a sharded loader lets each device read its own
shard. Writing goes through `io.fs`: atomic on local disks (temporary file, then a rename),
one object on `gs://`. Library errors (a truncated or malformed file) become
`SafetensorsError`, naming the file, and so does a floating tensor (or slice) read with a
NaN or Inf in it: weights never hold one, so it is a damaged file or a diverged run's.
The format has no checksum: any other damaged value in the tensor data reads as stored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, which safetensors' numpy API uses
import numpy as np
import safetensors
import safetensors.numpy

from adaflash_jax.io import fs


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, malformed or uses an unsupported dtype."""


class TensorView:
    """One stored tensor, read lazily; `.T` reverses the axes without reading anything."""

    def __init__(self, file: SafetensorsFile, name: str, transposed: bool = False):
        self._file, self.name, self._transposed = file, name, transposed
        stored = file.shape(name)
        self.shape = stored[::-1] if transposed else stored
        self.dtype = file.dtype(name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> TensorView:  # noqa: N802 - numpy's name
        return TensorView(self._file, self.name, not self._transposed)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        if self._transposed:
            return self._file.read(self.name, index[::-1]).T
        return self._file.read(self.name, index)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self._file.read(self.name, None)
        arr = arr.T if self._transposed else arr
        return arr if dtype is None else arr.astype(dtype)


class SafetensorsFile:
    """A memory-mapped .safetensors file: names, shapes and dtypes without reading data."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"safetensors file does not exist: {self.path}")
        try:
            self._file = safetensors.safe_open(self.path, framework="numpy")
            self._info = {}
            for name in self._file.keys():
                s = self._file.get_slice(name)
                self._info[name] = (tuple(s.get_shape()), _dtype(s.get_dtype(), name, self.path))
        except safetensors.SafetensorError as e:
            raise SafetensorsError(f"{self.path}: not a readable safetensors file ({e})") from None

    def keys(self) -> list[str]:
        return list(self._info)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][0]

    def dtype(self, name: str) -> np.dtype:
        return self._info[name][1]

    def get(self, name: str) -> TensorView:
        if name not in self._info:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return TensorView(self, name)

    def read(self, name: str, index: tuple | None) -> np.ndarray:
        """The tensor (`index` None) or the given slice of it, in the stored layout."""
        shape, dtype = self._info[name]
        try:
            if 0 in shape:  # the library cannot slice an empty tensor
                whole = np.zeros(shape, dtype)
                return whole if index is None else whole[index]
            if index is None or not shape:
                arr = self._file.get_tensor(name)
            else:
                arr = self._file.get_slice(name)[index]
        except safetensors.SafetensorError as e:
            raise SafetensorsError(f"{self.path}: tensor {name!r}: {e}") from None
        if arr.dtype.kind == "f" or arr.dtype == ml_dtypes.bfloat16:
            if not np.isfinite(arr.astype(np.float32, copy=False)).all():
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} holds NaN or Inf values (a damaged file, "
                    "or the weights of a diverged run)"
                )
        return arr


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _dtype(name: str, tensor: str, path: str) -> np.dtype:
    if name not in _DTYPES:
        raise SafetensorsError(f"{path}: tensor {tensor!r} has unsupported dtype {name}")
    return np.dtype(_DTYPES[name])


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes `tensors` to `path` (local or remote), never leaving a torn file behind."""
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
    for name, arr in arrays.items():
        if arr.dtype not in {np.dtype(t) for t in _DTYPES.values()}:
            raise SafetensorsError(f"tensor {name!r} has unsupported dtype {arr.dtype}")
    meta = dict(metadata or {"format": "pt"})
    path = os.fspath(path)
    if fs.is_remote(path):
        fs.write_bytes(path, safetensors.numpy.save(arrays, metadata=meta))
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    safetensors.numpy.save_file(arrays, tmp, metadata=meta)
    os.replace(tmp, path)

"""Seeded fuzzing of the file readers: truncations and byte flips of a target's config.json
and model.safetensors (header and tensor data) and of a drafter export's files.

Every case ends in one of two outcomes:
- refused: one of the errors the command-line mains print as one line
  (`cli.bad_input_errors`); any other exception is a hole;
- loaded faithfully: what the reader returns is exactly what the damaged file says. The
  formats carry no checksum (nor do published HF checkpoints), so a flipped byte that leaves
  a valid file (a tensor value that stays finite, a JSON digit) can only be loaded as that
  value; the test decodes the damaged file independently and asserts the loaded weights
  equal it bit for bit, and a flip that makes a value NaN or Inf is refused by the loaders'
  non-finite check. Anything else returned is garbage, and fails the test.

The counts per kind and outcome are printed (`pytest -s`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import struct

import numpy as np
import pytest
from flax import nnx

from adaflash_jax.cli import bad_input_errors
from adaflash_jax.drafter.checkpoint import (
    ACCEPT_FILE,
    accept_param_table,
    drafter_param_table,
    load_drafter,
    save_drafter,
)
from adaflash_jax.drafter.init import drafter_for_target
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.safetensors_io import _DTYPES
from adaflash_jax.model.checkpoint import hf_param_table, load_target, save_target
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import write_byte_tokenizer

CASES_PER_KIND = 25
FILES = {
    "target": ("config.json", "model.safetensors"),
    "drafter": ("config.json", "model.safetensors", ACCEPT_FILE),
}
# (owner, file, mutation); safetensors flips hit the header or the tensor data
KINDS = [
    (owner, name, mutation)
    for owner, names in FILES.items()
    for name in names
    for mutation in (
        ("truncate", "flip") if name.endswith(".json") else ("truncate", "flip-header", "flip-data")
    )
]


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    target = str(root / "target")
    vocab = write_byte_tokenizer(target)
    cfg = target_preset("test", vocab_size=vocab, eos_token_id=256)
    save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), target)
    drafter = str(root / "drafter")
    d = drafter_for_target(target, num_layers=1, block_size=4, num_features=2, seed=0)
    head = dataclasses.replace(d.config.length_head, accept_dim=8)  # the optional part too
    d = Drafter(dataclasses.replace(d.config, length_head=head), rngs=nnx.Rngs(0))
    save_drafter(d, drafter, dtype=None)  # float32: every flip is a float32 value
    assert os.path.isfile(os.path.join(drafter, ACCEPT_FILE))
    return {"target": target, "drafter": drafter, "root": root}


def _header_size(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _mutate(data: bytes, mutation: str, rng: np.random.Generator) -> bytes:
    if mutation == "truncate":
        return data[: int(rng.integers(0, len(data)))]
    lo, hi = 0, len(data)
    if mutation == "flip-header":
        hi = _header_size(data)
    elif mutation == "flip-data":
        lo = _header_size(data)
    out = bytearray(data)
    out[int(rng.integers(lo, hi))] ^= int(rng.integers(1, 256))
    return bytes(out)


def _decode(path: str) -> dict[str, np.ndarray]:
    """The tensors a safetensors file holds, decoded here without the library."""
    with open(path, "rb") as f:
        data = f.read()
    start = _header_size(data)
    header = json.loads(data[8:start])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        out[name] = np.frombuffer(data[start + begin : start + end], dtype).reshape(info["shape"])
    return out


def _assert_faithful(owner: str, directory: str, loaded) -> None:
    """The loaded weights are the damaged files' own values, bit for bit."""
    if owner == "target":
        tables = {"model.safetensors": hf_param_table(loaded)}
        with open(os.path.join(directory, "config.json")) as f:
            assert loaded.config == TargetConfig.from_hf_dict(json.load(f))
    else:
        tables = {"model.safetensors": drafter_param_table(loaded)}
        if loaded.length_head is not None and loaded.length_head.has_accept_output:
            tables[ACCEPT_FILE] = accept_param_table(loaded)
    for name, table in tables.items():
        stored = _decode(os.path.join(directory, name))
        for tensor, (var, transpose) in table.items():
            want = stored[tensor].T if transpose else stored[tensor]
            got = np.asarray(var.get_value())
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, tensor)
            assert np.isfinite(got).all(), (name, tensor)  # NaN/Inf must have been refused


def _load(owner: str, directory: str):
    return load_target(directory) if owner == "target" else load_drafter(directory)


def test_damaged_files_are_refused_in_one_line_or_loaded_faithfully(originals, tmp_path):
    contained = bad_input_errors()
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    holes = []
    for k, (owner, name, mutation) in enumerate(KINDS):
        for i in range(CASES_PER_KIND):
            rng = np.random.default_rng([k, i])
            directory = str(tmp_path / f"{owner}_{k}_{i}")
            shutil.copytree(originals[owner], directory)
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(_mutate(data, mutation, rng))
            kind = f"{owner} {name} {mutation}"
            try:
                loaded = _load(owner, directory)
            except contained as e:
                outcomes[kind]["refused: " + type(e).__name__] += 1
            except Exception as e:  # noqa: BLE001 - what the fuzz is looking for
                holes.append(f"{kind} case {i}: {type(e).__name__}: {e}")
                outcomes[kind]["ESCAPED " + type(e).__name__] += 1
            else:
                _assert_faithful(owner, directory, loaded)
                outcomes[kind]["loaded faithfully"] += 1
            shutil.rmtree(directory)
    for kind, counts in outcomes.items():
        print(f"{kind}: {dict(counts)}")
    assert sum(sum(c.values()) for c in outcomes.values()) == len(KINDS) * CASES_PER_KIND
    assert not holes, "\n".join(holes[:20])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(("owner", "name"), [(o, n) for o in FILES for n in FILES[o][1:]])
def test_a_flip_to_a_non_finite_value_is_refused(originals, tmp_path, owner, name, value):
    """Random flips rarely hit a float's exponent: here one value of the file's first tensor
    is made NaN or Inf outright, and the loader must refuse it by name."""
    directory = str(tmp_path / "d")
    shutil.copytree(originals[owner], directory)
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = _header_size(data)
    header = json.loads(data[8:start])
    tensor = next(k for k in header if k != "__metadata__")
    assert header[tensor]["dtype"] == "F32"
    begin = start + header[tensor]["data_offsets"][0]
    data[begin : begin + 4] = np.float32(value).tobytes()
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(bad_input_errors(), match=f"{tensor}.*NaN or Inf"):
        _load(owner, directory)

"""Run-directory IO through fsspec (a fake gs:// in memory), TensorBoard scalars through
tensorboardX, and the grain iterator position checkpointed by orbax."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from adaflash_jax.distill.batches import SequenceData, batch_iterator
from adaflash_jax.io import fs
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.train.checkpointing import Checkpointer
from adaflash_jax.train.tensorboard import ScalarWriter, read_scalars


class FakeGCS(MemoryFileSystem):
    """gs:// served from memory: what gcsfs would store, without a network."""

    protocol = ("gs", "gcs")
    store: dict = {}  # noqa: RUF012 - fsspec's class-level store, one per fake
    pseudo_dirs = [""]  # noqa: RUF012

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("gs://").removeprefix("gcs://"))


@pytest.fixture
def gcs(monkeypatch):
    """fsspec resolves gs:// to the fake for this test only (gcsfs comes back after)."""
    FakeGCS.store.clear()
    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "gs", FakeGCS)
    yield "gs://bucket/run"
    FakeGCS.store.clear()


def _data(m=6, s=12):
    rng = np.random.default_rng(0)
    mask = np.zeros((m, s), bool)
    mask[:, 4:10] = True
    return SequenceData(
        tokens=rng.integers(0, 50, (m, s)).astype(np.int32),
        loss_mask=mask,
        domain=np.arange(m, dtype=np.int32) % 2,
        domains=("code", "chat"),
        visited=np.full((m, 2), 4, np.int32),
        meta={"tau": {"code": 2.0}},
    )


def test_files_on_a_fake_gs(gcs):
    fs.write_text(f"{gcs}/a/report.json", json.dumps({"x": 1}))
    assert fs.exists(f"{gcs}/a/report.json") and fs.isdir(f"{gcs}/a")
    assert json.loads(fs.read_text(f"{gcs}/a/report.json")) == {"x": 1}
    assert fs.listdir(f"{gcs}/a") == ["report.json"]
    fs.save_npz(f"{gcs}/b.npz", x=np.arange(5))
    np.testing.assert_array_equal(fs.load_npz(f"{gcs}/b.npz")["x"], np.arange(5))
    fs.remove(f"{gcs}/b.npz")
    fs.remove(f"{gcs}/b.npz")  # absent: nothing to do
    assert not fs.exists(f"{gcs}/b.npz")
    assert fs.absolute(f"{gcs}/") == gcs  # a URL is left alone, not made a local path
    assert "/bucket/run/a/report.json" in FakeGCS.store  # really in the fake bucket


def test_sequence_data_round_trip_on_gs(gcs):
    data = _data()
    assert not SequenceData.exists(f"{gcs}/round0")
    data.save(f"{gcs}/round0")
    back = SequenceData.load(f"{gcs}/round0")
    for k in ("tokens", "loss_mask", "domain", "visited"):
        np.testing.assert_array_equal(getattr(back, k), getattr(data, k))
    assert back.domains == data.domains and back.meta == data.meta


def test_safetensors_to_gs_reads_back_bit_for_bit(gcs, tmp_path):
    arr = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    save_file({"w": arr}, f"{gcs}/m/model.safetensors")
    (tmp_path / "m.safetensors").write_bytes(fs.read_bytes(f"{gcs}/m/model.safetensors"))
    np.testing.assert_array_equal(
        np.asarray(SafetensorsFile(tmp_path / "m.safetensors").get("w")), arr
    )


def test_local_writes_are_atomic(tmp_path):
    fs.write_text(str(tmp_path / "d" / "x.json"), "{}")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["x.json"]  # no .tmp left


def test_scalar_writer_tags_round_trip(tmp_path):
    with ScalarWriter(tmp_path / "tb", enabled=True) as w:
        w.write(1, {"stage1/loss": 2.5, "stage1/lr": 1e-3})
        w.write(2, {"stage1/loss": 2.0})
    with ScalarWriter(tmp_path / "off", enabled=False) as w:  # other processes write nothing
        w.write(1, {"x": 1.0})
    got = read_scalars(tmp_path / "tb")
    assert got["stage1/loss"] == [(1, 2.5), (2, 2.0)]
    assert got["stage1/lr"] == [(1, pytest.approx(1e-3))]
    assert not (tmp_path / "off").exists()


def test_checkpoint_restores_the_grain_iterator_position(tmp_path):
    """grain's orbax handler saves the iterator position next to the state; a fresh
    iterator restored from it serves the batches the original would have served next."""
    data = _data()
    kw = dict(global_batch=4, num_anchors=2, block_size=3, seed=11, anchor_rule="visited")
    it = batch_iterator(data, **kw)
    for _ in range(3):
        next(it)
    with Checkpointer(tmp_path / "ck", save_every=1, async_save=False) as ckpt:
        assert ckpt.save(3, {"w": np.zeros(2, np.float32)}, it, {"round": 1}, force=True)
    want = [next(it) for _ in range(4)]  # crosses an epoch boundary
    with Checkpointer(tmp_path / "ck", save_every=1) as ckpt:
        state, extra = ckpt.restore({"w": np.zeros(2, np.float32)}, {"w": None})
        assert extra == {"round": 1} and ckpt.restored_step == 3
        fresh = batch_iterator(data, **kw)
        ckpt.restore_data(fresh)
    for w in want:
        got = next(fresh)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])


def test_prompt_files_on_gs(gcs):
    from adaflash_jax.distill.prompts import read_prompts

    fs.write_text(f"{gcs}/code.jsonl", '{"prompt": "def f():"}\n\n{"prompt": "x = 1"}\n')
    assert [p.text for p in read_prompts(f"{gcs}/code.jsonl")] == ["def f():", "x = 1"]
    assert {p.domain for p in read_prompts(f"{gcs}/code.jsonl")} == {"code"}
    with pytest.raises(FileNotFoundError, match="prompt file does not exist"):
        read_prompts(f"{gcs}/missing.jsonl")


def test_export_cli_bad_paths_are_one_line(tmp_path, capsys):
    from experiments import export

    with pytest.raises(SystemExit, match=r"^export failed: no checkpoint steps in .*nowhere"):
        export.main([str(tmp_path / "nowhere" / "ckpt" / "stage1")])
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"^export failed: .*ckpt holds no stage checkpoints"):
        export.main([str(tmp_path / "run")])


class FlakyFileSystem(MemoryFileSystem):
    """An in-memory object store whose next `failures` object writes raise, as a dropped
    connection does."""

    protocol = "flaky"
    failures = 0
    attempts = 0

    def pipe_file(self, path, value, **kwargs):
        type(self).attempts += 1
        if type(self).failures > 0:
            type(self).failures -= 1
            raise ConnectionResetError("connection reset by peer")
        return super().pipe_file(path, value, **kwargs)


def test_remote_writes_are_retried_and_a_lasting_failure_is_one_line(monkeypatch):
    """Two failed writes, then the third lands; a store that keeps failing ends in one
    StorageError naming the path, and the object keeps its previous content."""
    import fsspec

    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    monkeypatch.setattr(fs, "FIRST_PAUSE_S", 0.0)
    FlakyFileSystem.failures, FlakyFileSystem.attempts = 2, 0
    fs.write_text("flaky://run/report.json", "first")
    assert FlakyFileSystem.attempts == 3 and fs.read_text("flaky://run/report.json") == "first"
    FlakyFileSystem.failures = 100
    with pytest.raises(fs.StorageError, match="writing flaky://run/report.json failed 4 times"):
        fs.write_text("flaky://run/report.json", "second")
    assert fs.read_text("flaky://run/report.json") == "first"

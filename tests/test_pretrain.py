"""Target pretraining on the micro preset: learning, exact resume, HF export, sharding."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax import embedded
from adaflash_jax.data.corpus import build_corpus
from adaflash_jax.model.checkpoint import load_target
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.presets import micro
from adaflash_jax.train.pretrain import BATCH_KEYS, build_trainer, run_pretrain
from adaflash_jax.train.pretrain_data import to_device
from adaflash_jax.train.tensorboard import read_scalars

CFG = micro()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 3-step run through the CLI; and an embedded-cache build that was
    interrupted at step 2 (simulated preemption), then finished by default_target_dir."""
    from experiments import pretrain_target

    full_dir = str(tmp_path_factory.mktemp("full"))
    cache = str(tmp_path_factory.mktemp("cache"))
    summary = pretrain_target.main(["--preset", "micro", "--out", full_dir, "--data", "-1"])
    with open(os.path.join(full_dir, "metrics.json")) as f:
        full = json.load(f)
    mesh = make_mesh(data=-1)  # the CLI's mesh: all 8 fake devices on the data axis
    part_dir = os.path.join(cache, embedded.target_dir_name("micro"))
    corpus = build_corpus(CFG.corpus)
    stopped = run_pretrain(CFG, part_dir, stop_at_step=2, mesh=mesh, corpus=corpus, progress=False)
    complete_before = embedded.is_complete(part_dir)
    built = embedded.default_target_dir("micro", cache_dir=cache, mesh=mesh, progress=False)
    with open(os.path.join(built, "metrics.json")) as f:
        resumed = json.load(f)
    return dict(
        summary=summary,
        full=full,
        full_dir=full_dir,
        cache=cache,
        part_dir=part_dir,
        built=built,
        stopped=stopped,
        resumed=resumed,
        complete_before=complete_before,
    )


def test_three_step_smoke_decreases_loss(runs):
    losses = [loss for _, loss in runs["full"]["train_losses"]]
    assert len(losses) == 3
    assert losses[2] < losses[0] - 0.1
    assert losses[0] == pytest.approx(np.log(runs["full"]["vocab_size"]), abs=0.5)
    assert runs["summary"]["status"] == "done"
    assert set(runs["full"]["eval"]) == {"code", "prose", "math", "dialogue"}


def test_resume_reproduces_the_uninterrupted_run_exactly(runs):
    assert runs["stopped"]["status"] == "stopped" and runs["stopped"]["step"] == 2
    full = runs["full"]["train_losses"]
    assert [tuple(x) for x in full[:2]] == [tuple(x) for x in runs["stopped"]["train_losses"]]
    assert runs["resumed"]["train_losses"] == [full[2]]  # bit-exact next-step loss
    with open(os.path.join(runs["full_dir"], "model.safetensors"), "rb") as a:
        with open(os.path.join(runs["part_dir"], "model.safetensors"), "rb") as b:
            assert a.read() == b.read()


def test_embedded_cache_marks_completion_and_is_reused(runs, monkeypatch):
    assert not runs["complete_before"] and runs["built"] == runs["part_dir"]
    assert embedded.is_complete(runs["built"])
    assert not os.path.isdir(os.path.join(runs["built"], "checkpoints"))  # cache keeps no state

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a complete cache entry was rebuilt")

    import adaflash_jax.train.pretrain as pretrain

    monkeypatch.setattr(pretrain, "run_pretrain", no_rebuild)
    assert embedded.default_target_dir("micro", cache_dir=runs["cache"]) == runs["built"]
    monkeypatch.setenv(embedded.ENV_VAR, runs["cache"])
    assert embedded.default_target_dir("micro") == runs["built"]
    assert embedded.cache_root() == os.path.abspath(runs["cache"])


def test_output_directory_is_a_complete_hf_checkpoint(runs):
    d = runs["full_dir"]
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "metrics.json",
        "corpus/prompts_eval.jsonl",
    ):
        assert os.path.isfile(os.path.join(d, name)), name
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == cfg["eos_token_id"] == 0
    assert cfg["vocab_size"] == 512 and cfg["model_type"] == "qwen3"
    scalars = read_scalars(os.path.join(d, "tensorboard"))
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert "eval/math_loss" in scalars


def test_saved_target_loads_in_transformers_and_our_loader(runs):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = runs["full_dir"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok.encode("def add(a, b):\n    return a + b\nProblem: Compute 1/2 + 1/3.")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    ours = load_target(d, dtype=jnp.float32)(jnp.asarray([ids], jnp.int32)).logits_BxTxV
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 0.1  # trained, not all-zero


def test_sharded_step_equals_single_device_step():
    rng = np.random.default_rng(0)
    t1 = CFG.seq_len + 1
    seg = np.repeat(np.arange(1, 5, dtype=np.int32), -(-t1 // 4))[:t1]
    from adaflash_jax.data.pipeline import positions_from_segments

    batch = {
        "tokens": rng.integers(0, 512, (CFG.batch_size, t1)).astype(np.int32),
        "segment_ids": np.tile(seg, (CFG.batch_size, 1)),
    }
    batch["positions"] = positions_from_segments(batch["segment_ids"])
    results = []
    for mesh in (make_mesh(1, 1, 1, devices=jax.devices()[:1]), make_mesh(2, 2, 2)):
        trainer = build_trainer(CFG, 512, 0, mesh, total_steps=CFG.steps)
        state, metrics = trainer.step_fn(trainer.state, to_device(batch, trainer.data_sharding))
        results.append((float(metrics["loss"]), jax.device_get(state.params), state))
    (loss1, p1, _), (loss8, p8, s8) = results
    assert loss1 == pytest.approx(loss8, abs=1e-5)
    # Adam normalises each update, so a weight whose gradient is ~0 can move by up to the
    # step's lr in either direction on float noise alone; compare at well below that.
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        np.testing.assert_allclose(a, b, atol=1e-4)
    gate = s8.params["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert set(BATCH_KEYS) == set(batch)


def test_mesh_errors_name_the_field():
    with pytest.raises(ValueError, match="data=3"):
        make_mesh(3, 1, 1)
    with pytest.raises(ValueError, match="only one mesh axis"):
        make_mesh(-1, -1, 1)
    with pytest.raises(ValueError, match="tensor"):
        make_mesh(-1, 1, 3)


def test_grouped_optimizer_gives_each_group_its_lr():
    import optax

    from adaflash_jax.train.optimizer import OptimizerConfig, make_grouped_optimizer

    params = {"embed_tokens": jnp.ones((8, 4)), "norm": {"weight": jnp.ones((4,))}}
    groups = {
        "embed": OptimizerConfig(lr=1e-1, schedule="constant", weight_decay=0.0),
        "rest": OptimizerConfig(lr=1e-4, schedule="constant", weight_decay=0.0),
    }
    tx, schedules = make_grouped_optimizer(
        groups, lambda path: "embed" if path.startswith("embed") else "rest"
    )
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    # Adam's first step moves every weight by ~lr, whatever the (clipped) gradient size.
    assert float(jnp.abs(updates["embed_tokens"][...]).max()) == pytest.approx(1e-1, rel=1e-3)
    assert float(jnp.abs(updates["norm"]["weight"][...]).max()) == pytest.approx(1e-4, rel=1e-3)
    assert float(schedules["rest"](0)) == pytest.approx(1e-4)
    bad, _ = make_grouped_optimizer(groups, lambda path: "nope")
    with pytest.raises(ValueError, match="unknown group 'nope'"):
        bad.init(params)
    assert isinstance(tx, optax.GradientTransformation)


def test_preemption_guard_turns_sigterm_into_a_flag():
    import signal

    from adaflash_jax.train.checkpointing import PreemptionGuard

    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.should_stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop
    assert signal.getsignal(signal.SIGTERM) == before


def test_distributed_init_is_a_noop_for_one_process(monkeypatch):
    from adaflash_jax.train import mesh as mesh_lib

    for var in (
        "COORDINATOR_ADDRESS",
        "JAX_COORDINATOR_ADDRESS",
        "TPU_WORKER_HOSTNAMES",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
        "MEGASCALE_COORDINATOR_ADDRESS",
    ):
        monkeypatch.delenv(var, raising=False)
    assert mesh_lib.maybe_initialize_distributed() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    assert mesh_lib._detected_multi_process()

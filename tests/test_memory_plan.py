"""The memory planner: its parameter inventories against the real modules (abstractly, via
eval_shape, so nothing is allocated), its sharded sizes against real NamedShardings, its
formulas' scaling, its advice, and its CLI."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from adaflash_jax.model.config import ConfigError
from adaflash_jax.model.target import TargetLM
from adaflash_jax.plan import (
    GIB,
    DrafterShape,
    PlanInputs,
    choose_mesh,
    drafter_params,
    estimate,
    inputs_from_config,
    suggest,
    target_params,
    target_preset,
)
from adaflash_jax.plan.params import per_device_bytes, total_bytes
from adaflash_jax.sharding.rules import DECODE_RULES, TRAIN_RULES, state_shardings
from experiments import plan as plan_cli

TINY = target_preset("test", vocab_size=96, intermediate_size=48, num_key_value_heads=1)
# A tiny mixture of experts: 6 experts (split over fsdp 2), layer 1 dense.
TINY_MOE = dataclasses.replace(
    TINY,
    model_type="qwen3_moe",
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    mlp_only_layers=(1,),
)


def _abstract_params(module_fn):
    state = nnx.state(nnx.eval_shape(module_fn), nnx.Param)
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)), state


@functools.cache
def _abstract_target(cfg):
    return _abstract_params(lambda: TargetLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))


def _signature(shape, axes):
    return (tuple(shape), tuple(axes))


@pytest.mark.parametrize(
    "cfg",
    [target_preset("qwen3-8b"), TINY, TINY_MOE, target_preset("qwen3-30b-a3b")],
    ids=["qwen3-8b", "tiny", "tiny-moe", "qwen3-30b-a3b"],
)
def test_target_param_bytes_equal_eval_shape(cfg):
    leaves, _ = _abstract_target(cfg)
    real = sum(v.get_value().size * v.get_value().dtype.itemsize for v in leaves)
    assert total_bytes(target_params(cfg), 2) == real
    got = sorted(_signature(s.shape, s.logical_axes) for s in target_params(cfg))
    want = sorted(_signature(v.get_value().shape, v.get_metadata()["logical_axes"]) for v in leaves)
    assert got == want
    if cfg.hidden_size == 4096:  # Qwen3-8B: 8.19e9 parameters, 16.4 GB in bf16
        assert sum(s.size for s in target_params(cfg)) == 8_190_735_360
    if cfg.num_experts == 128:  # Qwen3-30B-A3B: 30.5e9 parameters
        assert sum(s.size for s in target_params(cfg)) == 30_532_122_624


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 8, 1)])
@pytest.mark.parametrize("rules", [TRAIN_RULES, DECODE_RULES], ids=["train", "decode"])
def test_per_device_bytes_equal_real_shardings(mesh, rules):
    for cfg in (TINY, TINY_MOE, target_preset("qwen3-1.7b")):
        _, state = _abstract_target(cfg)
        real_mesh = jax.make_mesh(
            mesh, ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
        )
        shardings = state_shardings(state, real_mesh, rules)
        real = 0
        for var, sh in zip(
            jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)),
            jax.tree.leaves(shardings),
            strict=True,
        ):
            shard = sh.shard_shape(var.get_value().shape)
            real += int(jnp.prod(jnp.array(shard))) * 2
        assert per_device_bytes(target_params(cfg), 2, mesh, rules) == real


def test_drafter_param_bytes_equal_eval_shape():
    drafter_mod = pytest.importorskip("adaflash_jax.drafter.model")
    config_mod = pytest.importorskip("adaflash_jax.drafter.config")
    for head in (True, False):
        dcfg = config_mod.DrafterConfig.for_target(
            TINY, mask_token_id=5, num_layers=2, num_features=3, length_head=head
        )
        leaves, _ = _abstract_params(lambda dcfg=dcfg: drafter_mod.Drafter(dcfg, rngs=nnx.Rngs(0)))
        shape = DrafterShape.like_target(
            TINY, num_layers=2, num_features=3, length_head_dim=256 if head else 0
        )
        got = sorted(_signature(s.shape, s.logical_axes) for s in drafter_params(shape))
        want = sorted(
            _signature(v.get_value().shape, v.get_metadata()["logical_axes"]) for v in leaves
        )
        assert got == want


def _inputs(**kw):
    base = dict(
        target=target_preset("qwen3-8b"),
        drafter=DrafterShape.like_target(target_preset("qwen3-8b")),
        mesh=(1, 8, 1),
        batch_size=8,
        seq_len=1024,
        num_anchors=64,
    )
    return PlanInputs(**{**base, **kw})


def test_formulas_scale_as_documented():
    p = estimate(_inputs())
    w = p.term("drafter params (fp32 master)")
    assert p.term("AdamW moments (2 x fp32)") == 2 * w == 2 * p.term("drafter grads (fp32)")
    # Qwen3-8B over 8-way fsdp: every weight divides; only the norms stay replicated.
    specs = target_params(target_preset("qwen3-8b"))
    norms = total_bytes([s for s in specs if s.logical_axes == ("norm",)], 2)
    assert p.term("target params (compute dtype)") == (total_bytes(specs, 2) - norms) // 8 + norms
    logits = "logits (teacher + student + grad, fp32)"
    assert p.term(logits) == 4 * 1 * 64 * 15 * 151936 * 4
    assert estimate(_inputs(logits_chunk=16)).term(logits) * 4 == p.term(logits)
    gathered = p.term("target layers gathered over fsdp (2)", "train")
    assert gathered == 2 * (total_bytes(target_params(target_preset("qwen3-8b"))[1:12], 2))
    head = p.term("LM head gathered over fsdp", "train")
    assert head == 4096 * 151936 * 2  # the whole bf16 LM head
    fixed = gathered + head  # batch-independent
    doubled = estimate(_inputs(batch_size=16)).phase_bytes("train") - fixed
    assert doubled == 2 * (p.phase_bytes("train") - fixed)
    assert estimate(_inputs(attention="fused")).term("drafter attention scores (naive)") == 0
    assert estimate(_inputs(remat=True)).phase_bytes("train") < p.phase_bytes("train")
    kv = estimate(_inputs(collect_slots=16)).term("target KV cache")
    # slots split over data·fsdp = 8 (sharding.rows): 2 rows per device
    assert kv == 36 * 2 * 2 * 1024 * 8 * 128 * 2  # L * (k,v) * rows * C * Kv * Dh * bf16
    kv = estimate(_inputs(collect_slots=12)).term("target KV cache")
    assert kv == 36 * 2 * 12 * 1024 * 8 * 128 * 2  # indivisible: every slot on every device
    assert p.peak_bytes == p.phase_bytes("persistent") + max(
        p.phase_bytes("train"), p.phase_bytes("collect")
    )


def test_advice_changes_really_fit():
    import dataclasses

    from adaflash_jax.distill.config import RunConfig, Stage2Spec

    p = estimate(_inputs(batch_size=64, num_anchors=512, seq_len=2048, collect_slots=8))
    hbm = 32 * GIB
    assert not p.fits(hbm)
    found = suggest(p, hbm)
    assert found, "a v6e-sized budget should be reachable by some single knob"
    for s in found:
        assert s.peak_bytes <= hbm * 0.9
        assert "remat" not in s.change  # no trainer knob: never advised
    # every advised knob is a field of the run config (or of its stage-2 section)
    fields = {f.name for f in dataclasses.fields(RunConfig)} | {"mesh"}
    fields |= {f.name for f in dataclasses.fields(Stage2Spec)}
    near = estimate(_inputs(num_anchors=256))
    knobs = {s.knob for s in suggest(near, 32 * GIB)} | {s.knob for s in found}
    assert knobs <= fields, knobs - fields
    assert "loss_chunk" in knobs  # chunking the loss is the cheapest fix at 256 anchors
    plan, fits = choose_mesh(_inputs(), 8, 95 * GIB)
    assert fits and plan.inputs.mesh[2] == 1  # no tensor parallelism needed on v5p


def test_config_reading_and_errors():
    cfg = types.SimpleNamespace(
        target_shape="qwen3-8b", mesh=(1, -1, 2), batch_size=16, seq_len=512, num_anchors=32,
        drafter_layers=3, target_layer_ids=(1, 9, 17, 25, 33),
    )  # fmt: skip
    inp = inputs_from_config(cfg, devices=16)
    assert inp.mesh == (1, 8, 2) and inp.drafter.num_layers == 3 and inp.drafter.num_features == 5
    assert inp.compute_bytes == 2
    assert inputs_from_config(cfg, devices=16, compute_dtype="float32").compute_bytes == 4
    with pytest.raises(ConfigError, match="devices"):
        inputs_from_config(types.SimpleNamespace(**{**vars(cfg), "mesh": (2, 2, 2)}), devices=16)
    with pytest.raises(ConfigError, match="divisible"):
        inputs_from_config(cfg, devices=16, batch_size=12)
    with pytest.raises(ConfigError, match="presets"):
        target_preset("qwen9-1t")


def test_cli_reads_config_file(tmp_path, capsys):
    path = tmp_path / "run.py"
    path.write_text(
        "import types\n"
        "def get_config():\n"
        "    return types.SimpleNamespace(target_shape='qwen3-8b', mesh=(1, -1, 1),\n"
        "        batch_size=8, seq_len=1024, num_anchors=64, block_size=16, drafter_layers=5)\n"
    )
    assert plan_cli.main(["--config", str(path), "--devices", "8", "--hbm-gib", "95"]) == 0
    out = capsys.readouterr().out
    assert "(1, 8, 1)" in out and "FITS" in out
    argv = ["--config", str(path), "--devices", "8", "--chip", "v5e", "--num-anchors", "512"]
    assert plan_cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "num_anchors 512 ->" in out
    assert plan_cli.main(["--config", str(path), "--devices", "6", "--hbm-gib", "95"]) == 2


def test_slice_table_rows():
    from adaflash_jax.plan.advice import slice_table

    table = slice_table(
        _inputs(num_anchors=64, seq_len=2048),
        {"8b": target_preset("qwen3-8b"), "32b": target_preset("qwen3-32b")},
        slices=(("v5p-16", "v5p", 8), ("v5litepod-8", "v5e", 8)),
    )
    rows = table.splitlines()
    assert rows[2].startswith("| v5p-16 | 8 | 95 GiB | (8, 1, 1) |")  # 8B: pure data parallel
    assert rows[3].startswith("| v5litepod-8 | 8 | 16 GiB | (1, ")  # 8B on v5e: no replicas
    assert rows[3].count("does not fit") == 1  # 32B does not fit 8 v5e chips

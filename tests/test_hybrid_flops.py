"""The planner and aot pieces on hybrid Gated-DeltaNet targets: useful FLOPs (`aot/flops.py`,
the numerator of MFU: each layer's matmul weights as the model builds them, abstractly;
attention pairs only on the full-attention layers; MoE counting its active experts and the
shared expert) and the memory planner's decode state (K/V only on attention layers, a
recurrent state on the DeltaNet ones)."""

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from adaflash_jax.aot import flops
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM


def _layer_matmul_weights(cfg):
    """Per layer: the weights one token multiplies, read off the abstract model (every 2-D
    kernel; of a [E, ...] expert tensor, the k routed experts' share)."""
    model = nnx.eval_shape(
        lambda: TargetLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    )
    out = [0] * cfg.num_hidden_layers
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[0] != "layers":
            continue
        n = 1
        for d in v.shape:
            n *= d
        if path[-1] == "kernel":
            out[path[1]] += n
        elif path[-1] in ("gate_proj", "up_proj", "down_proj") and len(v.shape) == 3:
            out[path[1]] += n * cfg.num_experts_per_tok // cfg.num_experts
    return out


@pytest.mark.parametrize("name", ["test-hybrid", "qwen3.5-9b", "qwen3.6-35b-a3b"])
def test_layer_flops_are_the_models_matmul_weights(name):
    cfg = target_preset(name)
    assert [flops.target_layer_active(cfg, i) for i in range(cfg.num_hidden_layers)] == (
        _layer_matmul_weights(cfg)
    )


def test_hybrid_forward_against_its_dense_twin():
    """The 9B against the same config with every layer full attention: a DeltaNet layer trades
    the gated attention's weights and causal pairs for its projections, conv and delta rule."""
    hybrid = target_preset("qwen3.5-9b")
    twin = dataclasses.replace(hybrid, layer_types=("full_attention",) * 32)
    b, s, d = 2, 2048, hybrid.hidden_size
    h, kv, dh = hybrid.num_attention_heads, hybrid.num_key_value_heads, hybrid.head_dim
    jk, dk, j, dv = 16, 128, 32, 128
    x = 2 * jk * dk + j * dv
    deltanet = d * x + d * j * dv + 2 * d * j + j * dv * d
    attention = 3 * d * h * dh + 2 * d * kv * dh  # q (with its gate), k, v, o
    assert flops.target_layer_active(twin, 0) - flops.target_layer_active(hybrid, 0) == (
        attention - deltanet
    )
    rule = j * (6.0 * dk * dv + 65 / 2 * (6 * dk + 4 * dv)) + 2 * 4 * x  # Tc = 64
    pairs = 4.0 * h * dh * b * s * (s + 1) / 2
    expected = 24 * (2.0 * (attention - deltanet) * b * s + pairs - rule * b * s)
    assert flops.target_forward(twin, b, s) - flops.target_forward(hybrid, b, s) == (
        pytest.approx(expected)
    )
    # the chunked rule is a few % of a DeltaNet layer's matmuls at Tc = 64
    assert 0.02 < rule / (2 * deltanet) < 0.05


def test_moe_hybrid_counts_active_and_shared_experts():
    """Qwen3.6-35B-A3B: a token multiplies the router, 8 of 256 experts and the shared expert
    with its gate; about 3e9 active parameters with the embedding and head."""
    cfg = target_preset("qwen3.6-35b-a3b")
    d = cfg.hidden_size
    per_layer = [flops.target_layer_active(cfg, i) for i in range(cfg.num_hidden_layers)]
    shared = 3 * d * cfg.shared_expert_intermediate_size + d
    routed = 8 * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
    assert per_layer[3] - per_layer[0] == (
        flops._mixer_active(cfg, 3) - flops._mixer_active(cfg, 0)
    )
    assert per_layer[0] == flops._mixer_active(cfg, 0) + routed + shared
    active = sum(per_layer) + 2 * cfg.vocab_size * d
    assert 2.5e9 < active < 3.5e9


def test_planner_counts_recurrent_state_not_kv_on_deltanet_layers():
    """The 9B's decode state per row: K/V on its 8 attention layers, and on each of its 24
    DeltaNet layers the fp32 delta state [32, 128, 128] and conv history [3, 8192]."""
    from adaflash_jax.plan import estimate
    from adaflash_jax.plan.inputs import PlanInputs
    from adaflash_jax.plan.memory_estimate import recurrent_state_bytes
    from adaflash_jax.plan.params import DrafterShape, target_layer_params

    hybrid = target_preset("qwen3.5-9b")
    assert recurrent_state_bytes(hybrid) == 4 * (32 * 128 * 128 + 3 * 8192) == 2_195_456
    twin = dataclasses.replace(hybrid, layer_types=("full_attention",) * 32)
    kw = dict(mesh=(1, 1, 1), batch_size=1, seq_len=2048, num_anchors=512, collect_slots=4)
    plans = {
        t: estimate(PlanInputs(target=t, drafter=DrafterShape.like_target(t), **kw))
        for t in (hybrid, twin)
    }
    per_row_token = 2 * 4 * 256 * 2  # K and V, 4 kv heads of 256, bf16
    assert plans[twin].term("target KV cache") == 32 * 4 * 2048 * per_row_token
    assert plans[hybrid].term("target KV cache") == 8 * 4 * 2048 * per_row_token
    assert plans[hybrid].term("target recurrent state (fp32)") == 24 * 4 * 2_195_456
    assert plans[twin].term("target recurrent state (fp32)") == 0
    # FSDP gathers the larger layer kind: the 9B's DeltaNet (67.4M) over its attention (58.7M)
    names = {s.name for s in target_layer_params(hybrid)}
    assert "in_proj_qkv" in names and "q_proj" not in names


def test_triangular_solve_seconds_are_added_back():
    """XLA's TPU cost model counts the custom call `triangular_solve` lowers to
    (InvertDiagBlocksLowerTriangular) as -1 s, as it does ConcatBitcast: the report adds it
    back (the chunked delta rule used it before main's 1e91e28: BENCHMARKS.md §10)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from adaflash_jax.aot.program import Program
    from adaflash_jax.aot.report import compile_program
    from adaflash_jax.aot.topology import parse_slice, slice_devices

    s = parse_slice("v5p-8")
    one = SingleDeviceSharding(slice_devices(s)[0])
    arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=one)  # noqa: E731
    solve = lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True)  # noqa: E731
    p = Program(
        name="chunk systems",
        kind="decode",
        fn=jax.jit(solve),
        args=(arg(64, 32, 16, 16), arg(64, 32, 16, 256)),
    )
    f = compile_program(p, s.chip, 1)
    assert f.compiled, f.error
    assert f.triangular_inversions == (1 if f.xla_optimal_seconds < 0 else 0)
    assert f.optimal_seconds == pytest.approx(f.xla_optimal_seconds + f.triangular_inversions)
    assert 0 < f.optimal_seconds < 0.01


def test_dense_twin():
    from adaflash_jax.aot.abstract import dense_twin
    from adaflash_jax.model.config import ConfigError

    twin = dense_twin(target_preset("qwen3.5-9b"))
    assert twin.is_hybrid and not any(twin.is_linear_layer(i) for i in range(32))
    with pytest.raises(ConfigError, match="hybrid"):
        dense_twin(target_preset("qwen3-8b"))

"""What the non-finite guard costs the stage-2 step: the same step (the tiny CPU config's
shapes: the embedded tiny target D 256 × 4 layers, V 4096; a 2-layer K 8 drafter with the
length head; batch 8 × 128 tokens, 8 anchors) built with the guard (loss poisoning + optax's
`apply_if_finite`) and without, timed interleaved on one device: `--rounds` rounds, each
timing `--steps` steps of one build and then of the other (order alternating), so that a
loaded machine slows both alike. Prints each build's median and minimum seconds per step,
the ratio of the medians and of the minima, and the median of the per-round ratios.

    JAX_PLATFORMS=cpu python -m experiments.guard_overhead [--rounds 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _build(guard: bool):
    """(jitted step, a fresh state, the batch) for the stage-2 step with or without the guard."""
    import jax
    import numpy as np
    from flax import nnx

    from adaflash_jax.distill import steps
    from adaflash_jax.distill.state import fresh_drafter, new_train_state
    from adaflash_jax.drafter.config import DrafterConfig
    from adaflash_jax.model.presets import target_preset
    from adaflash_jax.model.target import TargetLM
    from adaflash_jax.sharding.rules import TRAIN_RULES
    from adaflash_jax.train.mesh import make_mesh
    from adaflash_jax.train.optimizer import OptimizerConfig

    b, s, n, k = 8, 128, 8, 8
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    target_cfg = target_preset("tiny")
    t_graph, t_params = nnx.split(TargetLM(target_cfg, rngs=nnx.Rngs(0)), nnx.Param)
    dcfg = DrafterConfig.for_target(
        target_cfg, mask_token_id=target_cfg.vocab_size - 1, num_layers=2, block_size=k,
        target_layer_ids=(1, 2),
    )  # fmt: skip
    d_graph, params = fresh_drafter(dcfg, mesh=mesh, rules=TRAIN_RULES, seed=0)
    opt = OptimizerConfig(lr=3e-4, schedule="constant", b2=0.999, decay_all=True)
    tx, schedules = steps.make_optimizer(
        {"drafter": opt, "head": opt, "accept": opt}, clip_norm=1.0, nonfinite_guard=guard
    )
    state, shardings = new_train_state(params, t_params, tx, mesh=mesh, rules=TRAIN_RULES, seed=0)
    spec = steps.StepSpec(kind="stage2", block_size=k, gamma=dcfg.loss_gamma,
                          feature_layers=(1, 2), nonfinite_guard=guard)  # fmt: skip
    bsh = steps.batch_shardings(mesh, TRAIN_RULES, b)
    fn = steps.jit_step(
        steps.make_step(spec, d_graph, t_graph, tx, schedules),
        state_shardings=shardings,
        batch_shardings_=bsh,
    )
    rng = np.random.default_rng(0)
    mask = np.zeros((b, s), bool)
    mask[:, 16:] = True
    host = {
        "tokens": rng.integers(0, target_cfg.vocab_size - 1, (b, s)).astype(np.int32),
        "loss_mask": mask,
        "anchors": np.sort(rng.choice(np.arange(16, s - k), (b, n)), axis=1).astype(np.int32),
        "valid": np.ones((b, n), bool),
    }
    return fn, state, steps.put_batch(host, bsh)


def _time(fn, state, batch, n: int):
    import jax

    t0 = time.perf_counter()
    for _ in range(n):
        state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t0) / n


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    from adaflash_jax.cli import one_line_errors

    with one_line_errors():
        return measure(args)


def measure(args) -> dict:
    builds = {name: list(_build(name == "guard")) for name in ("guard", "no_guard")}
    for build in builds.values():  # compile and warm up
        build[1], _ = _time(build[0], build[1], build[2], 2)
    times: dict[str, list[float]] = {name: [] for name in builds}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for name in order:
            fn, state, batch = builds[name]
            builds[name][1], seconds = _time(fn, state, batch, args.steps)
            times[name].append(seconds)
    out = {f"{name}_median_s": round(statistics.median(t), 5) for name, t in times.items()}
    out.update({f"{name}_min_s": round(min(t), 5) for name, t in times.items()})
    out["ratio_of_medians"] = round(out["guard_median_s"] / out["no_guard_median_s"], 4)
    out["ratio_of_minima"] = round(out["guard_min_s"] / out["no_guard_min_s"], 4)
    per_round = [g / o for g, o in zip(times["guard"], times["no_guard"])]
    out["median_round_ratio"] = round(statistics.median(per_round), 4)
    out["round_ratios"] = [round(x, 3) for x in per_round]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

"""The run's optional evaluations and sampled collection (distill/evaluation.py, docs/design.md
§4.2 and §4.5), at unit level on tiny random models (no pipeline run):

- sampled τ is the engine's own τ for those requests, and temperature 0 is the greedy table;
- τ by position pools each verify step into the bucket of its block's first position;
- the length head's calibration entries (predicted against realised length, widths);
- stage 2's engine collection at `stage2.collect_temperature` > 0 stores text distributed
  as the target's sampled text: a χ² test against plain sampling, as
  tests/test_sampled_lossless.py does, and a greedy collection fails it.
"""

import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx
from test_sampled_lossless import P_BIASED, P_HONEST, chi_square_p

from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.distill import calibration, schedule
from adaflash_jax.distill import evaluation as E
from adaflash_jax.distill import report as R
from adaflash_jax.distill.collect import Trajectory
from adaflash_jax.distill.config import (
    ConfigError,
    DataSpec,
    DraftSpec,
    EvalSpec,
    RunConfig,
    Stage1Spec,
    Stage2Spec,
)
from adaflash_jax.distill.context import Context
from adaflash_jax.distill.overrides import override
from adaflash_jax.distill.shapes import slot_capacity
from adaflash_jax.distill.stages import Stage2Pool, Trainer
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.train.mesh import make_mesh

V, K, TEMPERATURE = 16, 4, 1.0
CFG = target_preset("test", vocab_size=V)


@pytest.fixture(scope="module")
def models():
    """A tiny-vocab target with peaked distributions and a random drafter sharing its head:
    proposals are peaked on the wrong tokens, yet some are accepted (as in
    tests/test_sampled_lossless.py)."""
    target = TargetLM(CFG, rngs=nnx.Rngs(0))
    target.lm_head.kernel.set_value(target.lm_head.kernel[...] * 15.0)
    dcfg = DrafterConfig.for_target(
        CFG, mask_token_id=V - 1, num_layers=1, block_size=K, num_features=2, length_head=True
    )
    return target, Drafter(dcfg, rngs=nnx.Rngs(1))


# ---- τ by position -----------------------------------------------------------------------


def test_tau_by_position_buckets_each_step_by_its_anchor():
    trajs = [
        Trajectory(np.array([0, 127, 128, 300]), np.array([3, 1, 0, 2])),
        Trajectory(np.array([255, 511, 512, 4000]), np.array([1, 0, 3, 3])),
    ]
    got = E.tau_by_position(trajs)
    assert list(got["tau"]) == ["0-128", "128-256", "256-512", "512+"]
    assert got["steps"] == {"0-128": 2, "128-256": 2, "256-512": 2, "512+": 2}
    # (accepted + 1) pooled over each bucket's steps: [3, 1], [0, 1], [2, 0], [3, 3]
    assert got["tau"] == {"0-128": 3.0, "128-256": 1.5, "256-512": 2.0, "512+": 4.0}
    sparse = E.tau_by_position([Trajectory(np.array([5, 600]), np.array([1, 2]))])
    assert sparse["steps"] == {"0-128": 1, "128-256": 0, "256-512": 0, "512+": 1}
    assert math.isnan(sparse["tau"]["128-256"]) and sparse["tau"]["512+"] == 3.0
    assert E.bucket_names((0, 64)) == ("0-64", "64+")
    assert E.tau_by_position([], (0, 64))["steps"] == {"0-64": 0, "64+": 0}
    with pytest.raises(ValueError, match="increase"):
        E.tau_by_position(trajs, (0, 128, 128))


def test_position_table_prints_every_bucket():
    by_method = {"stage1": E.tau_by_position([Trajectory(np.array([0, 600]), np.array([1, 3]))])}
    text = R.position_table(by_method)
    assert "512+" in text and "2.000 (1)" in text and "4.000 (1)" in text and "nan (0)" in text


# ---- sampled τ -----------------------------------------------------------------------------


def _measure(calls, params, t):
    calls.append((params, t))
    return {"code": 10 * t}


def test_sampled_tables_take_the_greedy_table_at_zero():
    finals = {"stage1": "p1", "adaflash": "p2"}
    greedy = {"stage1": {"code": 2.0}, "adaflash": {"code": 2.5}}
    calls = []
    got = E.sampled_tables(finals, (0.0, 0.7, 1.0), greedy, functools.partial(_measure, calls))
    assert list(got) == ["0", "0.7", "1"]
    assert got["0"] == greedy and got["1"] == {"stage1": {"code": 10.0}, "adaflash": {"code": 10.0}}
    assert all(t > 0 for _, t in calls) and len(calls) == 4  # never measured at 0


def test_engine_tau_is_the_engines_tau_at_that_temperature(models):
    """Pooled per domain from the engine's own per-request records, same seed and slots; a
    sampled run accepts drafts, and its τ differs from the greedy run's."""
    target, drafter = models
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V - 1, n).tolist() for n in (5, 7, 6, 4, 5, 6)]
    domain_ids, domains, new = [0, 1, 0, 1, 1, 0], ("a", "b"), 12
    kw = dict(max_new_tokens=new, slots=4, seed=3, eos_ids=())
    tau = E.engine_tau(target, drafter, prompts, domain_ids, domains, temperature=1.0, **kw)
    engine = SpeculativeEngine(
        target,
        drafter,
        slots=4,
        capacity=slot_capacity(max(map(len, prompts)), new, K),
        temperature=1.0,
        seed=3,
        eos_ids=(),
    )
    results = engine.generate([(p, new) for p in prompts])
    for d, name in enumerate(domains):
        mine = [r for r, i in zip(results, domain_ids) if i == d]
        want = sum(sum(a + 1 for a in r.accepted) for r in mine) / sum(r.steps for r in mine)
        assert tau[name] == pytest.approx(want, rel=1e-12)
    assert sum(sum(r.accepted) for r in results) > 3  # not vacuous
    greedy = E.engine_tau(target, drafter, prompts, domain_ids, domains, temperature=0.0, **kw)
    assert greedy != tau


def test_eval_knobs_are_checked():
    cfg = RunConfig()
    assert cfg.eval.temperatures == () and cfg.eval.long_new_tokens == 0  # off by default
    got = override(cfg, {"eval.temperatures": "(0, 0.7, 1)", "eval.long_new_tokens": "640"})
    assert got.eval.temperatures == (0.0, 0.7, 1.0) and got.eval.long_new_tokens == 640
    assert override(cfg, {"eval.temperatures": "1.0"}).eval.temperatures == (1.0,)
    for value in ("(-0.5,)", "(0.7, 0.7)", "('hot',)", "(float('nan'),)"):
        with pytest.raises(ConfigError, match=r"eval\.temperatures"):
            override(cfg, {"eval.temperatures": value})
    with pytest.raises(ConfigError, match=r"eval\.long_new_tokens 64 must exceed seq_len"):
        override(cfg, {"eval.long_new_tokens": "64"})
    with pytest.raises(ConfigError, match=r"eval\.long_new_tokens"):
        override(cfg, {"eval.long_new_tokens": "-1"})
    with pytest.raises(ConfigError, match=r"eval\.long_per_domain"):
        EvalSpec(long_per_domain=0)


def test_tau_plot_and_tables_with_sampled_entries(tmp_path):
    tau = {"stage1": {"code": 2.0, "math": 3.0}, "adaflash": {"code": 2.5, "math": 3.5}}
    sampled = {"0": tau, "1": {"stage1": {"code": 1.5, "math": 2.0}, "adaflash": tau["stage1"]}}
    extra = R.extra_summaries({"tau_sampled": sampled})
    assert extra["summary_sampled"]["1"]["adaflash"] == R.summarise(tau)["stage1"]
    text = R.extra_tables(extra)
    assert "temperature 1 " in text and "temperature 0 " not in text
    path = str(tmp_path / "tau.png")
    R.plot_tau(path, tau, sampled)
    one = str(tmp_path / "greedy.png")
    R.plot_tau(one, tau)
    import matplotlib.image

    # one panel per temperature > 0 under the greedy one
    assert matplotlib.image.imread(path).shape[0] == 2 * matplotlib.image.imread(one).shape[0]


def test_long_eval_prompts_are_the_longest_documents():
    from adaflash_jax import embedded
    from adaflash_jax.data.corpus import DOMAINS

    got = embedded.long_eval_prompts(2)
    assert [r["domain"] for r in got] == [d for d in DOMAINS for _ in range(2)]
    docs = embedded._corpus("tiny").docs(split="eval")
    for d in DOMAINS:
        lengths = sorted((len(x.text) for x in docs if x.domain == d and x.prompt), reverse=True)
        mine = [r["prompt"] for r in got if r["domain"] == d]
        text = {x.prompt: len(x.text) for x in docs if x.domain == d}
        assert [text[p] for p in mine] == lengths[:2]


def test_long_prompts_of_a_run():
    """The embedded target's long set is its longest held-out documents' prompts; a target of
    the run's own uses its eval prompts; `eval.long_per_domain` of each domain either way."""
    from adaflash_jax import embedded
    from adaflash_jax.distill import prompts as P

    cfg = RunConfig(eval=EvalSpec(long_per_domain=2), data=DataSpec(domains=("code", "math")))
    ctx = _context(cfg, eval_prompts=[])
    want = [r["prompt"] for r in embedded.long_eval_prompts(2) if r["domain"] in ("code", "math")]
    assert [p.text for p in E.long_prompts(ctx)] == want
    own = P.from_records([{"domain": d, "prompt": f"{d} {i}"} for d in "ab" for i in range(3)])
    cfg = RunConfig(target_path="/nonexistent", eval=EvalSpec(long_per_domain=2))
    got = E.long_prompts(_context(cfg, eval_prompts=own))
    assert [p.domain for p in got] == ["a", "a", "b", "b"] and set(got) <= set(own)


# ---- the length head's calibration ---------------------------------------------------------


def test_head_calibration_entries():
    """K = 4: r·K against A + 1 per block, the serving widths at rate 1.3 and 1."""
    trajs = [
        Trajectory(np.arange(3), np.array([0, 3, 1]), np.array([0.25, 0.5, 0.5])),
        Trajectory(np.arange(1), np.array([3]), np.array([1.0])),
    ]
    got = calibration.head_calibration(trajs, 4)
    # predicted r·K = 1, 2, 2, 4; realised A + 1 = 1, 4, 2, 4; y = 0.25, 1, 0.5, 1
    assert got["blocks"] == 4
    assert got["mse"] == pytest.approx((0 + 0.25 + 0 + 0) / 4)
    assert got["predicted_len"] == 2.25 and got["realised_len"] == 2.75
    assert got["mae_len"] == pytest.approx(0.5)
    # widths at rate 1.3: round(1.3) = 1, round(2.6) = 3, 3, clamp(5.2) = 4
    assert got["width_exact"] == 0.5 and got["width_covers"] == 0.75
    assert got["width_exact_rate1"] == 0.75  # widths 1, 2, 2, 4
    assert got["by_predicted"] == {
        "1": {"blocks": 1, "realised_len": 1.0},
        "2": {"blocks": 2, "realised_len": 3.0},
        "4": {"blocks": 1, "realised_len": 4.0},
    }
    assert got["corr"] == pytest.approx(np.corrcoef([0.25, 0.5, 0.5, 1], [0.25, 1, 0.5, 1])[0, 1])
    assert calibration.head_calibration([], 4) == {"blocks": 0}
    with pytest.raises(ValueError, match="head_r"):
        calibration.head_calibration([Trajectory(np.arange(1), np.array([0]))], 4)
    text = R.calibration_table({"head_init": got})
    assert "head_init" in text and "0.062" in text  # the mse, 0.0625


def test_calibration_points_follow_the_runs_training_order():
    cfg = RunConfig(stage2=Stage2Spec(rounds=2, methods=("adaflash", "stage1_long", "sft")))
    assert schedule.calibration_points(cfg) == [
        "head_init",
        "stage2_adaflash_round0",
        "stage2_adaflash_round1",
        "head_refit_adaflash",
        "head_init_stage1_long",
        "stage2_sft_round0",
        "stage2_sft_round1",
        "head_refit_sft",
    ]


def test_the_schedule_orders_every_stage_from_its_start():
    """2 methods × 2 rounds (and stage1_long): each track's start, its steps and their
    points; the calibration points are the steps' own, in the same order."""
    s2 = Stage2Spec(rounds=2, steps_per_round=3, methods=("adaflash", "sft", "stage1_long"))
    cfg = RunConfig(stage1=Stage1Spec(steps=5), stage2=s2)
    got = [(t.drafter, t.start, [s.name for s in t.steps]) for t in schedule.tracks(cfg)]
    assert got == [
        ("stage1", schedule.INIT, ["stage1", "head_init"]),
        ("adaflash", "stage1", ["stage2_adaflash", "head_refit_adaflash"]),
        ("sft", "stage1", ["stage2_sft", "head_refit_sft"]),
        ("stage1_long", schedule.INIT, ["stage1_long", "head_init_stage1_long"]),
    ]
    by_name = {s.name: s for s in schedule.steps(cfg)}
    assert by_name["stage1"].total == 5 and by_name["stage1_long"].total == 5 + 2 * 3
    assert by_name["stage2_sft"].points == ("stage2_sft_round0", "stage2_sft_round1")
    assert by_name["stage2_sft"].method == "sft"
    assert {s.phase for s in schedule.tracks(cfg)[1].steps} == {"stage2_adaflash"}
    points = [p for s in schedule.steps(cfg) for p in s.points]
    assert schedule.calibration_points(cfg) == points and points[0] == "head_init"
    # no re-fit: a method is its rounds; an imported drafter skips stage 1 (0 steps)
    bare = RunConfig(
        draft=DraftSpec(init_from="/drafter"),
        stage2=Stage2Spec(rounds=2, methods=("adaflash", "sft"), head_refit=False),
    )
    assert [s.name for s in schedule.steps(bare)] == [
        "stage1",
        "head_init",
        "stage2_adaflash",
        "stage2_sft",
    ]
    assert schedule.steps(bare)[0].total == 0
    assert schedule.calibration_points(bare) == [
        "head_init",
        "stage2_adaflash_round0",
        "stage2_adaflash_round1",
        "stage2_sft_round0",
        "stage2_sft_round1",
    ]


# ---- stage 2 collection at temperature -------------------------------------------------------

N, PROMPT, NEW = 2048, [3, 1, 4, 1, 5], 4


def _context(cfg, *, run_dir="", drafter_cfg=None, eval_prompts=()) -> Context:
    """A resolved run of `cfg` on the test target, built by hand (no target directory)."""
    return Context(
        cfg=cfg,
        run_dir=run_dir,
        target_dir="",
        target_cfg=CFG,
        tokenizer=None,
        drafter_cfg=drafter_cfg,
        mesh_shape=(1, 1, 1),
        eos_ids=(),
        pad_id=0,
        train_prompts=[],
        eval_prompts=list(eval_prompts),
        progress=False,
    )


def _trainer(tmp_path, models, collect_temperature):
    """A Trainer on one device whose stage 2 collects with the engine at the temperature."""
    target, drafter = models
    cfg = RunConfig(
        seq_len=16,
        draft=DraftSpec(block_size=K),
        data=DataSpec(max_prompt_len=8, max_new_tokens=NEW),
        stage2=Stage2Spec(
            collector="engine",
            collect_temperature=collect_temperature,
            collect_slots=N,
            prompts_per_round=N,
        ),
        seed=2,
    )
    ctx = _context(cfg, run_dir=str(tmp_path), drafter_cfg=drafter.config)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    d_graph, params = nnx.split(drafter)
    trainer = Trainer(ctx, mesh, nnx.split(target), d_graph, writer=None, guard=None)
    return trainer, params


def _collected(tmp_path, models, collect_temperature, rounds=(0,)):
    """Stage 2's buffers of `rounds` (`Trainer.collected`, the run's collection path), all
    from the same drafter → per round (response tokens [N, NEW], τ)."""
    trainer, params = _trainer(tmp_path, models, collect_temperature)
    pool = Stage2Pool([PROMPT] * N, np.zeros(N, np.int32), ("a",))
    out = []
    for r in rounds:
        data = trainer.collected("adaflash", r, params, pool)
        start = len(PROMPT)
        assert data.loss_mask[:, start : start + NEW].all()
        assert data.visited is not None and (data.visited[:, 0] == start).all()
        out.append((data.tokens[:, start : start + NEW], data.meta["tau"]["a"]))
    return out


def _counts(tokens_NxM):
    return np.stack([np.bincount(tokens_NxM[:, j], minlength=V) for j in range(NEW)])


def test_sampled_collection_follows_the_targets_sampled_distribution(tmp_path, models):
    target, _ = models
    plain = generate(target, [PROMPT] * N, max_new_tokens=NEW, temperature=TEMPERATURE, seed=1)
    plain_counts = _counts(np.asarray(plain))
    (tokens, tau), (again, _) = _collected(tmp_path / "sampled", models, TEMPERATURE, (0, 1))
    assert tau > 1.1, "drafts must be accepted for the check to cover speculation"
    p = chi_square_p(plain_counts, _counts(tokens))
    assert p > P_HONEST, f"sampled collection differs from the target's sampling (p={p:.2e})"
    # each round samples from its own stream: the same prompts, another text
    assert np.mean(np.any(tokens != again, axis=1)) > 0.5
    # the test's power: a collection that ignored the temperature (greedy) is caught
    [(greedy, _)] = _collected(tmp_path / "greedy", models, 0.0)
    p = chi_square_p(plain_counts, _counts(greedy))
    assert p < P_BIASED, f"the test failed to catch greedy collection (p={p:.2e})"

"""Deviceless TPU compiles (libtpu, no TPU attached): slice names, the chip table, and the
tiny config's stage-1 / stage-2 steps and engine step compiled for a v5p:2x2x1 slice, with
the compiler's memory figures checked against the sharded shapes the project gives them."""

import json
import subprocess
import sys

import jax
import pytest

from adaflash_jax.aot import chips, flops
from adaflash_jax.aot import programs as P
from adaflash_jax.aot.abstract import per_chip_bytes
from adaflash_jax.aot.report import Figures, compile_program
from adaflash_jax.aot.report import table as table_text
from adaflash_jax.aot.topology import parse_slice, slice_devices
from adaflash_jax.aot.train_programs import train_programs
from adaflash_jax.distill.config_file import load_config
from adaflash_jax.distill.shapes import run_drafter, run_mesh, run_target
from adaflash_jax.model.config import ConfigError
from adaflash_jax.plan import advice, estimate, inputs_from_config
from adaflash_jax.plan.compiled import compile_phases, format_compiled
from adaflash_jax.train.mesh import make_mesh
from experiments import plan as plan_cli
from experiments import tpu_compile as tpu_compile_cli

TINY = "experiments/configs/tiny.py"


def test_slice_names():
    v5p = parse_slice("v5p-64")
    assert (v5p.chips, v5p.topology, v5p.chips_per_host_bounds) == (32, "v5p:2x4x4", (2, 2, 1))
    assert v5p.hosts == 8  # Google's table: v5p-64 = 32 chips on 8 hosts
    assert parse_slice("v5p-8").topology == "v5p:2x2x1"
    assert parse_slice("v5p-128").topology == "v5p:4x4x4"
    assert parse_slice("v5e-256").topology == "v5e:16x16"
    assert parse_slice("v5litepod-8").topology == "v5e:2x4"
    six = parse_slice("v6e-64")
    assert (six.topology, six.chips_per_host_bounds, six.hosts) == ("v6e:8x8", (2, 4, 1), 8)
    assert parse_slice("v6e-4").chips_per_host_bounds == (2, 2, 1)
    raw = parse_slice("v5p:4x4x2")
    assert (raw.chips, raw.chip.name) == (32, "v5p")
    for bad in ("v5p-6", "v4-8", "v5e:2x2x2", "v6e-3", "h100"):
        with pytest.raises(ConfigError, match="accepted: v5p-8"):
            parse_slice(bad)


def test_one_chip_table():
    assert chips.CHIP_HBM_GIB == {"v5e": 16.0, "v5p": 95.0, "v6e": 32.0}
    assert advice.CHIP_HBM_GIB is chips.CHIP_HBM_GIB  # the planner reads the one table
    v5p = chips.chip("v5p")
    assert (v5p.hbm_bandwidth, v5p.bf16_peak, v5p.cores_per_chip) == (2765e9, 459e12, 2)
    assert "cloud.google.com/tpu/docs/v5p" in chips.markdown_table()


def test_abstract_devices_match_the_slice():
    for name, kind in (("v5p-8", "TPU v5"), ("v5e-8", "TPU v5 lite"), ("v6e-4", "TPU v6 lite")):
        s = parse_slice(name)
        devices = slice_devices(s)
        assert len(devices) == s.chips and devices[0].device_kind == kind


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY)
    s = parse_slice("v5p:2x2x1")
    mesh = make_mesh(*run_mesh(cfg, s.chips), devices=slice_devices(s))
    return cfg, s, mesh


@pytest.fixture(scope="module")
def phases(tiny):
    """The planner's compiled phases: the tiny run's stage-2 step, engine step (W = K) and
    engine prefill."""
    cfg, s, _ = tiny
    return compile_phases(cfg, s)


def _check_train_step(f, program, kind, cfg, s):
    assert f.compiled, f.error
    # the compiler's arguments are the sharded state + batch we lowered against (TPU layouts
    # pad small arrays a little), and the donated state comes back in place (aliased)
    state, batch = program.args
    assert f.argument_bytes == pytest.approx(per_chip_bytes((state, batch)), rel=0.01)
    assert f.alias_bytes >= 0.99 * per_chip_bytes(state)
    assert 0 < f.temp_bytes < f.hbm_bytes and f.fits and 0 < f.headroom < 1
    assert f.optimal_seconds > 0 and f.bytes_accessed > 0
    target = run_target(cfg)
    useful = flops.train_step(
        kind, target, run_drafter(cfg, target), cfg.batch_size, cfg.seq_len, cfg.num_anchors
    )
    assert f.useful_flops == pytest.approx(useful / s.chips)
    assert f.flops >= 0.9 * f.useful_flops  # XLA counts the useful work (and masked pairs)
    assert 0 < f.mfu < 1 and f.tokens_per_s_per_chip > 0


def test_stage1_step_compiles_for_tpu(tiny):
    cfg, s, mesh = tiny
    (p,) = train_programs(cfg, mesh, kinds=("stage1",))
    _check_train_step(compile_program(p, s.chip, s.chips), p, "stage1", cfg, s)


def test_stage2_and_engine_steps_compile_for_tpu(tiny, phases):
    cfg, s, mesh = tiny
    (stage2,) = train_programs(cfg, mesh, kinds=("stage2",))
    _check_train_step(phases.train, stage2, "stage2", cfg, s)
    engine, prefill = phases.collect
    assert engine.program == "engine W=8 B=16" and engine.compiled, engine.error
    assert engine.argument_bytes >= engine.weight_bytes > 0 and engine.fits
    assert engine.flops > 0 and engine.optimal_seconds > 0
    assert engine.vs_floor > 1  # nothing beats reading the weights once
    assert prefill.program == "prefill B=16" and prefill.compiled and prefill.fits
    # the planner's collect phase: the larger engine program plus the AdamW moments
    assert phases.moments_bytes == per_chip_bytes(stage2.args[0].opt_state) > 0
    biggest = max(engine.total_bytes, prefill.total_bytes)
    assert phases.collect_bytes == biggest + phases.moments_bytes
    assert phases.peak_bytes == max(phases.train_bytes, phases.collect_bytes)


def test_plan_prints_the_compiled_peak(tiny, phases):
    cfg, s, _ = tiny
    plan = estimate(inputs_from_config(cfg, devices=s.chips))
    text = format_compiled(phases, plan, 95.0, 0.1)
    assert "COMPILED" in text and "engine W=8 B=16" in text and "FITS" in text


def test_plan_compile_flag_checks_its_input(capsys):
    base = ["--config", TINY, "--compile"]
    assert plan_cli.main([*base, "v5p-9"]) == 2
    assert plan_cli.main([*base, "v5p-8", "--devices", "8"]) == 2
    assert plan_cli.main([*base, "v5p-8", "--logits-chunk", "4"]) == 2
    err = capsys.readouterr().err
    assert "accepted: v5p-8" in err and "has 4 chips" in err and "logits_chunk" in err


def test_cost_table_follows_the_engine_step_calibration():
    def fig(name, ms, rows, width):
        return Figures(program=name, kind="decode", hbm_bytes=1, chips=1, compiled=True,
                       optimal_seconds=ms / 1e3, rows=rows, width=width)  # fmt: skip

    figs = [fig("plain B=1", 2.0, 1, 1), fig("draft B=1", 0.7, 1, 0)]
    figs += [fig(f"engine W={w} B=1", 2.5 + 0.1 * w, 1, w) for w in (2, 4)]
    figs += [fig(f"packed F={f} B=1", 2.4 + 0.1 * f, 1, f) for f in (2, 3)]
    table = P.cost_table(figs, device="v5p:2x2x1", model="test")
    # step_cost's meaning: verify[1] = the plain step; draft + verify[W] = the drafted step
    assert table.widths == (1, 2, 4) and table.draft_ms == pytest.approx((0.7,))
    assert table.verify_ms[0] == pytest.approx((2.0, 2.7 - 0.7, 2.9 - 0.7))
    assert table.step_ms(1, (2,))[0] == pytest.approx(2.7, rel=1e-6)
    # and the packed form: draft + packed[f] = the packed step at token bucket rows·f
    assert table.fills == (1, 2, 3)
    assert table.packed_ms[0] == pytest.approx((2.0, 2.6 - 0.7, 2.7 - 0.7))
    assert "compiler estimate" in table.device


def test_decode_estimate_without_msa():
    """`no_msa`: the same program also compiled without memory-space assignment, whose VMEM
    prefetch copies XLA's cost analysis counts as bytes accessed: never more bytes than with
    it, and every operand of two chained dots counted once (experiments/tpu_matmul_chain.py)."""
    from experiments.tpu_matmul_chain import programs

    s = parse_slice("v5p-8")
    mesh = make_mesh(1, 1, s.chips, devices=slice_devices(s))
    two = programs(mesh, 512, 2048, s.chips, layers=1)[1]
    f = compile_program(two, s.chip, s.chips, no_msa=True)
    assert f.compiled and f.no_msa_seconds > 0 and f.no_msa_vs_floor > 0
    assert f.weight_bytes <= f.no_msa_bytes_accessed <= min(1.1 * f.weight_bytes, f.bytes_accessed)
    assert "no MSA" in table_text([f], s.chip) and f.to_json()["no_msa_over_floor"] > 0
    plain = compile_program(two, s.chip, s.chips)  # not asked: no second compile
    assert plain.no_msa_seconds == 0 and "no MSA" not in table_text([plain], s.chip)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.tpu_compile", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_bad_input_is_one_line(capsys):
    # one true subprocess: its whole stderr is the one line (no traceback, no log noise)
    out = _cli("--topology", "v5p-7")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "accepted: v5p-8" in out.stderr
    # the other refusals take the same path (main's one `except`): checked in-process
    for args, want in (
        (["--topology", "v5p-8", "--set", "batch_size=6"], "batch_size 6 is not divisible"),
        (["--topology", "v5p-8", "--only", "eval"], "--only takes"),
    ):
        assert tpu_compile_cli.main(args) == 2
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and want in err, err


def test_cli_writes_the_report(tmp_path, capsys):
    # in-process (a subprocess would only add a jax/libtpu start-up): the CLI's main
    path = tmp_path / "tiny.json"
    assert (
        tpu_compile_cli.main(["--topology", "v5p-8", "--only", "draft", "--json", str(path)]) == 0
    )
    out = capsys.readouterr().out
    assert "compiler estimates" in out and "| draft B=16 |" in out
    data = json.loads(path.read_text())
    assert data["label"].startswith("compiler estimates") and data["uncosted_kernels"] == []
    assert data["topology"] == "v5p:2x2x1" and data["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    (draft,) = data["programs"]
    assert draft["fits"] and draft["optimal_seconds"] > 0 and draft["estimated_over_floor"] > 1


def test_jax_backend_stays_cpu():
    # loading libtpu for deviceless compiles never initialises a TPU backend here
    assert jax.default_backend() == "cpu"


@pytest.mark.parametrize("kind", ["stage1", "stage2", "head_init"])
def test_loss_loop_flops_complete_the_compilers_count(kind):
    """The compiler counts one chunk of the loss loop. With what `loop_flops_left_out` adds,
    the work at 2 chunks and at 4 chunks is the same: only if its per-kind logits count per
    position (body) is the one the compiled step really runs."""
    import jax.numpy as jnp

    from adaflash_jax.distill import losses
    from adaflash_jax.drafter.config import DrafterConfig
    from adaflash_jax.model.config import TargetConfig

    b, n, k, d, v = 2, 8, 4, 256, 512
    t_cfg = TargetConfig(
        vocab_size=v, hidden_size=d, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    dc = DrafterConfig.for_target(t_cfg, mask_token_id=v - 1, num_layers=1, block_size=k)
    hid = jax.ShapeDtypeStruct((b, n, k - 1, d), jnp.float32)
    head = jax.ShapeDtypeStruct((d, v), jnp.float32)
    labels = jax.ShapeDtypeStruct((b, n, k - 1), jnp.int32)

    def counted(chunk):
        def loss(h, head, labels, teacher):
            st = losses.position_stats(h, head, labels, teacher, chunk=chunk)
            return jnp.sum(st.ce) + (0.0 if st.kl is None else jnp.sum(st.kl))

        teacher = hid if kind == "stage2" else None
        fn = loss if kind == "head_init" else jax.value_and_grad(loss)  # as the step
        return jax.jit(fn).lower(hid, head, labels, teacher).compile().cost_analysis()["flops"]

    def total(chunk):
        left = flops.loop_flops_left_out(
            kind, t_cfg, dc, b, 1, n, loss_chunk=chunk, attention="dense", attention_chunk=1
        )
        return counted(chunk) + left, left

    two, left_two = total(n // 2)
    four, left_four = total(n // 4)
    assert left_four == 1.5 * left_two > 0  # 3 quarter-bodies vs 1 half-body
    assert four == pytest.approx(two, rel=0.03)


def test_cli_serve_compiles_tree_steps(tmp_path, capsys):
    """--serve --trees: the drafted step with draft trees, every row its whole tree, beside
    the packed chain step of the same tokens per row; a malformed tree is argparse's line."""
    path = tmp_path / "serve.json"
    argv = ["--topology", "v5e-8", "--serve", "--rows", "2", "--widths", "8", "--fills", "8"]
    assert (
        tpu_compile_cli.main([*argv, "--trees", "2x7", "--capacity", "128", "--json", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "| tree 2x7 B=2 |" in out and "| packed F=8 B=2 |" in out
    programs = {p["program"]: p for p in json.loads(path.read_text())["programs"]}
    tree, chain = programs["tree 2x7 B=2"], programs["packed F=8 B=2"]
    assert tree["fits"] and tree["optimal_seconds"] > 0
    assert tree["width"] == chain["width"] == 8  # the same verify tokens per row
    with pytest.raises(SystemExit) as e:
        tpu_compile_cli.main([*argv, "--trees", "7"])
    assert e.value.code == 2 and "TOPKxNODES" in capsys.readouterr().err

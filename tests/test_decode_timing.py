"""The decode harnesses' shared timing path (bench/decode_timing.py, bench/loop_timing.py) and
the benchmark_decode CLI that prints them, on a random "test"-shaped target."""

import json

import jax.numpy as jnp

from adaflash_jax.bench.decode_timing import slots_table
from adaflash_jax.bench.loop_timing import bench_models, bench_plain, plain_table
from experiments import benchmark_decode


def test_slots_comparison_through_the_cli(tmp_path, capsys):
    """`--slots` runs `compare_slots`: plain then speculative, each timed on the shared path."""
    out = tmp_path / "slots.json"
    argv = ["--config", "test", "--slots", "2", "--prompt-len", "10", "--new-tokens", "4"]
    benchmark_decode.main([*argv, "--requests", "3", "--json", str(out)])
    plain, spec = json.loads(out.read_text())["rows"]
    assert (plain["method"], spec["method"], spec["policy"]) == ("plain", "speculative", "fixed")
    for r in (plain, spec):  # every request ran to its budget
        assert r["requests"] == 3 and r["tokens"] == 3 * 4 and r["wall_s"] > 0
    assert spec["ratio_to_plain"] == spec["tokens_per_s"] / plain["tokens_per_s"]
    assert plain["draft_fraction"] == 0.0 and spec["block_size"] == 8
    printed = capsys.readouterr().out
    assert "block=8" in printed and slots_table([plain, spec]).splitlines()[2] in printed


def test_plain_loop_rates():
    target, _ = bench_models(None, None, shape="test", dtype=jnp.float32)
    row = bench_plain(target, batch=2, prompt_len=4, new_tokens=3, repeats=1)
    assert row["median_s"] > 0 and row["decode_tok_s"] > 0 and row["end_to_end_tok_s"] > 0
    assert row["end_to_end_tok_s"] == 2 * 3 / row["median_s"]
    assert plain_table([row]).splitlines()[1].split()[:4] == ["plain", "2", "4", "3"]

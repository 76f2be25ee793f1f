"""`python -m experiments.benchmark --micro` end to end: every (method, concurrency, domain)
cell in bench.json, lossless outputs, the scheduler reconstruction, traces, report files."""

from __future__ import annotations

import json
import os
import types

import pytest

from adaflash_jax.bench import methods
from adaflash_jax.bench import throughput_bench as tb
from adaflash_jax.io.cost_table import VerifyCostTable
from experiments import benchmark, project_throughput

REQUIRED = ("method", "policy", "concurrency", "domain", "tokens_per_s", "tau",
            "mean_verify_width", "ratio_to_plain")  # fmt: skip


def test_parse_method_and_errors():
    assert methods.parse_method("plain") == methods.Method()
    m = methods.parse_method("adaflash:adaflash:threshold=0,rate=1.5")
    assert m.options == (("threshold", 0), ("rate", 1.5)) and "threshold=0" in m.label
    m = methods.parse_method("adaflash:goodput:skip_draft=False+verify=packed")
    assert m.options == (("skip_draft", False), ("verify", "packed"))
    bench = tb.ThroughputBench.__new__(tb.ThroughputBench)  # the option split needs no models
    bench.settings, bench.methods = tb.BenchSettings(concurrencies=(1,)), (m,)
    assert bench.engine_options(m) == {"verify": "packed"} and bench.packs("adaflash")
    assert bench.policy_kwargs(m) == {"estimator": "confidence", "skip_draft": False}
    for bad in ("stage1", "x:nope", "a:fixed:novalue"):
        with pytest.raises(methods.BenchError):
            methods.parse_method(bad)
    assert tb.cell_requests([[1], [2]], 3, 5) == [([1], 5), ([2], 5), ([1], 5)]


def test_micro_benchmark_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    cost = tmp_path / "cost.json"
    VerifyCostTable(  # a given table skips the calibration (it has its own tests)
        rows=(1, 2), widths=(1, 2, 4), verify_ms=((1, 2, 3), (2, 3, 5)), draft_ms=(1, 1)
    ).save(cost)
    argv = ["--micro", "--out", str(out), "--concurrency", "1,2", "--buckets", "1,2,4"]
    argv += ["--cost-table", str(cost), "--adaflash-threshold", "1"]  # the rule acts at c=2
    argv += ["--repeats", "1"]  # warm-up, then one timed pass (still checked compile-free)
    assert benchmark.main(argv) == 0
    assert "plain" in capsys.readouterr().out

    rows = json.loads((out / "bench.json").read_text())
    labels = ["plain", "stage1/fixed", "adaflash/fixed", "adaflash/adaflash", "adaflash/goodput"]
    domains = ["code", "prose", "math", "dialogue", "all"]
    cells = {(r["label"], r["concurrency"], r["domain"]) for r in rows}
    assert cells == {(m, c, d) for m in labels for c in (1, 2) for d in domains}
    assert len(rows) == len(cells)
    for r in rows:
        assert all(k in r for k in REQUIRED), r
        assert r["tokens_per_s"] > 0 and r["tau"] >= 1
        assert r["matches_plain"] and r["occupancy_exact"], r  # lossless; scheduler model
        assert r["compiles_in_timed_pass"] == 0
        if r["method"] == "plain":
            assert r["ratio_to_plain"] == 1 and r["mean_verify_width"] == 1
        else:
            assert r["mean_verify_width"] in (1, 2, 4) or r["policy"] != "fixed"
        if r["policy"] == "goodput":
            # random micro drafters accept almost nothing and a draft costs a whole plain
            # step in this table: the skip arm runs mostly plain steps
            assert r["draft_fraction"] < 0.5, r
        elif r["method"] != "plain":
            assert r["draft_fraction"] == 1
    by = {(r["label"], r["concurrency"], r["domain"]): r for r in rows}
    assert by[("adaflash/adaflash", 1, "all")]["policy_active_fraction"] == 0  # 1 row <= 1
    assert by[("adaflash/adaflash", 2, "all")]["policy_active_fraction"] > 0
    assert "ideal_speedup" in by[("stage1/fixed", 1, "all")]

    traces = json.loads((out / "bench_traces.json").read_text())
    assert len(traces["cells"]) == 4 * 2 * 4  # every speculative cell
    tables = traces["meta"]["goodput_tables"]  # what each goodput engine decided with
    assert set(tables) == {"adaflash/goodput c=1", "adaflash/goodput c=2"}
    given = VerifyCostTable.load(str(cost))
    assert all(VerifyCostTable.from_json(t) == given for t in tables.values())  # as given
    cell = traces["cells"][0]
    steps = [len(t) for t in cell["accepted"]]
    assert [len(t) for t in cell["requested"]] == steps and cell["loop_steps"] > 0
    for name in ("bench.md", "throughput.png", "tau.png"):
        assert os.path.getsize(out / name) > 0
    assert "adaflash rule activity" in (out / "bench.md").read_text()

    # the traces feed the projection (here with the bench's own cost table)
    proj = tmp_path / "proj.json"
    argv = ["--traces", str(out / "bench_traces.json"), "--cost-from-traces"]
    assert project_throughput.main(argv + ["--json", str(proj), "--threshold", "0"]) == 0
    got = {r["label"] for r in json.loads(proj.read_text())["rows"]}
    assert got == {"plain", "stage1/fixed", "adaflash/fixed", "adaflash/goodput",
                   "adaflash/adaflash"}  # fmt: skip


def test_head_estimator_without_the_output_is_refused_before_any_compute():
    """A goodput method reading the head's per-position output fails at construction when
    the drafter has none (not after minutes of calibrating other methods)."""
    drafter = types.SimpleNamespace(config=types.SimpleNamespace(block_size=4), length_head=None)
    settings = tb.BenchSettings(concurrencies=(1,))
    for method in ("adaflash:goodput:estimator=head", "adaflash:adaflash"):
        with pytest.raises(methods.BenchError, match="adaflash"):
            tb.ThroughputBench(None, {"adaflash": drafter}, {"code": [[1]]},
                               [methods.parse_method(method)], settings)  # fmt: skip
    head_settings = tb.BenchSettings(concurrencies=(1,), goodput_estimator="head")
    with pytest.raises(methods.BenchError, match="accept_probs"):
        tb.ThroughputBench(None, {"adaflash": drafter}, {"code": [[1]]},
                           [methods.parse_method("adaflash:goodput")], head_settings)  # fmt: skip

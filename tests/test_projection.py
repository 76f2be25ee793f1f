"""The throughput projection against hand computations on a synthetic cost table and traces,
the cost-table filling, and the occupancy reconstruction the trace filter relies on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaflash_jax.bench import cost_model as cm
from adaflash_jax.bench import projection as pj
from adaflash_jax.bench.occupancy import occupancy, running_per_step
from experiments import project_throughput

COST = {  # rows 1 and 4; widths 1, 2, 4; draft 2 ms and 4 ms
    "format": "adaflash_jax.verify_cost/1",
    "rows": [1, 4],
    "widths": [1, 2, 4],
    "verify_ms": [[10.0, 11.0, 12.0], [20.0, 24.0, 30.0]],
    "draft_ms": [2.0, 4.0],
    "device": "synthetic",
    "model": "",
}


def _cell(policy, accepted, requested, *, concurrency=1, threshold=None):
    return {
        "label": f"ada/{policy}",
        "method": "ada",
        "policy": policy,
        "policy_options": {} if threshold is None else {"threshold": threshold},
        "concurrency": concurrency,
        "domain": "code",
        "block_size": 4,
        "buckets": [1, 2, 4],
        "accepted": accepted,
        "requested": requested,
    }


def _write(tmp_path, cells):
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"cells": cells, "cost_tables": {}}))
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(COST))
    return str(traces), str(cost)


def test_projection_equals_hand_computation(tmp_path, capsys):
    # full block: A = 3, 0 | 1, 3 (two requests); rule (always on): w = 4, 2 with A = 2, 1
    cells = [
        _cell("fixed", ["30", "13"], ["33", "33"]),
        _cell("goodput", ["00"], ["00"]),  # marks goodput as run; its own trace is unused
        _cell("adaflash", ["21"], ["31"], threshold=0),
    ]
    traces, cost = _write(tmp_path, cells)
    out = tmp_path / "proj.json"
    argv = ["--traces", traces, "--cost", cost, "--concurrency", "1,2", "--threshold", "0"]
    assert project_throughput.main(argv + ["--json", str(out)]) == 0
    assert "PROJECTION" in capsys.readouterr().out
    got = {(r["label"], r["concurrency"]): r for r in json.loads(out.read_text())["rows"]}

    # B=1: verify 10/11/12, draft 2. τ at W=4: (4+1+2+4)/4 = 2.75.
    assert got[("plain", 1)]["tokens_per_s"] == pytest.approx(1000 / 10)
    assert got[("ada/fixed", 1)]["tokens_per_s"] == pytest.approx(1000 * 2.75 / 14)
    assert got[("ada/goodput", 1)]["verify_width"] == 4  # W=2: 1750/13 < 2750/14
    # rule at B=1: bucket 2 or 4 with p 1/2 each; τ = (3 + 2)/2
    assert got[("ada/adaflash", 1)]["tokens_per_s"] == pytest.approx(2500 / (2 + 11.5))
    # B=2: rows interpolate linearly: verify 40/3, 46/3, 18; draft 8/3
    assert got[("plain", 2)]["tokens_per_s"] == pytest.approx(2000 / (40 / 3))
    assert got[("ada/fixed", 2)]["tokens_per_s"] == pytest.approx(5500 / (8 / 3 + 18))
    assert got[("ada/fixed", 2)]["ratio_to_plain"] == pytest.approx((5500 / (8 / 3 + 18)) / 150)
    # max of two requests: bucket 2 with p 1/4, bucket 4 with p 3/4
    step = 8 / 3 + 0.25 * 46 / 3 + 0.75 * 18
    assert got[("ada/adaflash", 2)]["tokens_per_s"] == pytest.approx(5000 / step)
    assert got[("ada/adaflash", 2)]["verify_width"] == pytest.approx(0.25 * 2 + 0.75 * 4)

    # above the default threshold 48 nothing of the rule is measured here; below it, it is
    # the full block of the same drafter
    assert project_throughput.main(["--traces", traces, "--cost", cost, "--json", str(out)]) == 0
    got = {(r["label"], r["concurrency"]): r for r in json.loads(out.read_text())["rows"]}
    assert got[("ada/adaflash", 4)]["tokens_per_s"] == got[("ada/fixed", 4)]["tokens_per_s"]


def test_rule_steps_are_kept_only_above_the_threshold(tmp_path):
    # 2 slots, requests of 2 and 1 steps: 2 rows run at step 0, 1 at step 1.
    assert list(running_per_step([2, 1], 2)) == [2, 1]
    cell = _cell("adaflash", ["12", "3"], ["01", "2"], concurrency=2, threshold=1)
    traces, _ = _write(tmp_path, [cell])
    acc = pj.load_acceptance(traces)["ada"]
    assert list(acc.rule_requested) == [1, 3] and list(acc.rule_accepted) == [1, 3]


def test_occupancy_is_fifo_into_free_slots():
    starts, end = occupancy([3, 1, 2, 2], 2)
    assert list(starts) == [0, 0, 1, 3] and end == 5
    assert list(running_per_step([3, 1, 2, 2], 2)) == [2, 2, 2, 1, 1]


def test_cost_fill_rules_and_errors(tmp_path):
    m = cm.Measurements()
    m.verify.update({(1, 1): 10.0, (1, 4): 16.0, (8, 2): 30.0, (8, 4): 40.0})
    model = cm.build(m, (1, 2, 4), draft_ms={1: 1.0, 8: 2.0})
    assert model.verify(1, 2) == pytest.approx(12.0)  # linear between W=1 and W=4
    # B=8 W=1 is outside its widths: 30 · (B=1's W1/W2 = 10/12)
    assert model.verify(8, 1) == pytest.approx(30 * 10 / 12)
    assert any("B=8 W=1" in n for n in model.notes)
    assert model.draft(4.5) == pytest.approx(1.5)
    with pytest.raises(cm.CostError, match="outside the measured rows"):
        model.verify(16, 1)
    design = cm.build(m, (1, 2, 4))  # no draft measured: docs/design.md §7
    assert design.draft(1) == pytest.approx(2.613)
    with pytest.raises(cm.CostError, match="cannot fill"):
        cm.build(cm.Measurements(verify={(1, 1): 1.0, (2, 2): 2.0}), (1, 2))
    assert cm.parse_draft_ms("1:2.6,128:16") == {1: 2.6, 128: 16.0}
    np.testing.assert_allclose(model.verify_ms[0], [10, 12, 16])


def test_reads_a_tpu_cost_table_of_compiler_estimates(tmp_path, capsys):
    from adaflash_jax.aot.programs import cost_table
    from adaflash_jax.aot.report import Figures

    def fig(name, ms, rows, width):
        return Figures(program=name, kind="decode", hbm_bytes=1, chips=8, compiled=True,
                       optimal_seconds=ms / 1e3, rows=rows, width=width)  # fmt: skip

    figs = []
    for b, plain in ((1, 10.0), (4, 20.0)):
        figs += [fig(f"plain B={b}", plain, b, 1), fig(f"draft B={b}", b / 2, b, 0)]
        figs += [fig(f"engine W={w} B={b}", plain + b / 2 + w, b, w) for w in (2, 4)]
    path = tmp_path / "tpu.json"
    cost_table(figs, device="v5e:2x4", model="8B").save(path)
    traces, _ = _write(tmp_path, [_cell("fixed", ["30", "13"], ["33", "33"])])
    out = tmp_path / "proj.json"
    argv = ["--traces", traces, "--cost", str(path), "--concurrency", "1", "--json", str(out)]
    assert project_throughput.main(argv) == 0
    assert "v5e:2x4: compiler estimates" in capsys.readouterr().out
    got = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    # plain = verify[1] = the plain step; fixed W=4 = draft + verify[4] = the drafted step
    assert got["plain"]["tokens_per_s"] == pytest.approx(1000 / 10.0)
    assert got["ada/fixed"]["tokens_per_s"] == pytest.approx(1000 * 2.75 / (10 + 0.5 + 4))


def test_packed_rule_pays_for_the_sum_of_widths():
    """Under packed verify a step costs the token bucket B·f holding Σ w: requests of 1 and
    4 tokens at B = 4 (Σ between 4 and 16) against the padded rule, which pays W = 4 unless
    all four rows ask for 1."""
    table = dict(
        COST, fills=[1, 2, 3, 4], packed_ms=[[10.0, 11.0, 11.5, 12.0], [20.0, 24.0, 27.0, 30.0]]
    )
    m = cm.Measurements()
    cost = cm.build(cm.add_table(m, cm.VerifyCostTable.from_json(table), "t"), (1, 2, 4))
    requested, accepted = np.asarray([1, 4] * 50), np.asarray([0, 3] * 50)
    tps, tau, fill = pj.packed_rule_tps(cost, 4, requested, accepted, draws=20000)
    sums = np.arange(5) * 3 + 4  # k rows at 4 tokens, 4 − k at 1
    p_k = np.asarray([1, 4, 6, 4, 1]) / 16
    buckets = np.searchsorted([4, 8, 12, 16], sums)
    verify = float(np.dot(p_k, np.asarray([20.0, 24.0, 27.0, 30.0])[buckets]))
    assert tau == 2.5 and fill == pytest.approx(2.5, rel=0.02)
    assert tps == pytest.approx(1e3 * 4 * 2.5 / (4.0 + verify), rel=0.01)
    padded, _, _ = pj.rule_tps(cost, 4, requested, accepted, (1, 2, 4))
    assert tps > padded

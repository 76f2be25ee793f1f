"""Aggregation of τ over seeds: mean ± std per method, paired ratios, the goals' verdicts."""

import numpy as np
import pytest

from adaflash_jax.distill import seeds as S


def _report(adaflash, sft, long):
    return {
        "tau": {
            "adaflash": {"a": adaflash[0], "b": adaflash[1]},
            "sft": {"a": sft[0], "b": sft[1]},
            "stage1_long": {"a": long[0], "b": long[1]},
        }
    }


def test_aggregate_pairs_ratios_per_seed():
    reports = [
        _report((3.0, 2.0), (2.8, 1.9), (2.0, 2.0)),
        _report((4.0, 3.0), (3.9, 2.8), (3.0, 3.0)),
    ]
    agg = S.aggregate(reports)
    mean, std = agg["methods"]["adaflash"]["tau"]
    assert mean == pytest.approx(3.0) and std == pytest.approx(np.std([2.5, 3.5], ddof=1))
    cv0 = np.std([3.0, 2.0]) / 2.5
    assert agg["methods"]["adaflash"]["cv"][0] == pytest.approx((cv0 + np.std([4, 3]) / 3.5) / 2)
    ratios = {(r["num"], r["den"]): r for r in agg["ratios"]}
    r = ratios[("adaflash", "sft")]
    want = [2.5 / 2.35, 3.5 / 3.35]  # paired per seed
    assert r["mean"] == pytest.approx(np.mean(want))
    assert r["met"] == (np.mean(want) - np.std(want, ddof=1) >= 1.05)
    long = ratios[("adaflash", "stage1_long")]
    assert long["mean"] == pytest.approx(np.mean([2.5 / 2.0, 3.5 / 3.0])) and long["met"]
    assert agg["lowest_cv"] in ("adaflash", "sft")  # stage1_long is a baseline, not ranked
    text = S.markdown(agg)
    assert "| adaflash |" in text and "adaflash / stage1_long" in text and "met" in text


def test_each_sampled_temperature_and_the_positions_aggregate_on_their_own():
    """Sampled tables aggregate like the greedy one, paired per seed; the greedy table stays
    at the top level; the stage-2 CV ranking leaves out stage 1; τ by position averages."""
    reports = []
    for k in (0.0, 1.0):
        r = _report((3.0 + k, 2.0), (2.8 + k, 1.9), (2.0, 2.0))
        hot = {"stage1": {"a": 1.0, "b": 1.0}, "adaflash": {"a": 2.0 + k, "b": 1.0},
               "sft": {"a": 1.5, "b": 1.0}}  # fmt: skip
        r["tau_sampled"] = {"0": r["tau"], "1.0": hot}
        r["tau_by_position"] = {"adaflash": {"tau": {"0-128": 2.0 + k, "512+": 1.0}}}
        reports.append(r)
    agg = S.aggregate(reports)
    assert list(agg["temperatures"]) == ["0", "1.0"]
    assert agg["methods"] == agg["temperatures"]["0"]["methods"]
    hot = agg["temperatures"]["1.0"]
    (ratio,) = [r for r in hot["ratios"] if r["den"] == "sft"]
    want = [1.5 / 1.25, 2.0 / 1.25]
    assert ratio["mean"] == pytest.approx(np.mean(want))
    assert ratio["std"] == pytest.approx(np.std(want, ddof=1))
    assert hot["lowest_cv"] == "stage1" and hot["lowest_cv_stage2"] == "sft"
    mean, std = agg["positions"]["adaflash"]["0-128"]
    assert mean == pytest.approx(2.5) and std == pytest.approx(np.std([2, 3], ddof=1))
    text = S.markdown(agg)
    assert "temperature 1.0" in text and "τ by position" in text and "| 2.500 ± 0.707 |" in text

"""Draft quality over seeds: τ of every method across several runs of the same recipe.

Each run's `report.json` holds τ per (method, domain), greedy and at each sampled temperature
it measured (`eval.temperatures`), and optionally τ by position. Per seed and temperature, a
method scores its mean τ over domains and its cross-domain CV (std / mean); over seeds we
report mean ± sample std.
Method ratios (e.g. adaflash / sft) are paired per seed, so a seed that is easy for both
methods does not inflate the spread; a ratio goal is met "beyond the seed spread" when its
mean minus one std still clears it.
"""

from __future__ import annotations

import json
import math

import numpy as np

from adaflash_jax.distill.report import summarise
from adaflash_jax.distill.stage_config import STAGE2_OBJECTIVE
from adaflash_jax.io import fs

# (numerator, denominator, goal) of the draft-quality goals, checked at every temperature
RATIO_GOALS = (("adaflash", "sft", 1.05), ("adaflash", "stage1_long", 1.10))


def load_reports(run_dirs) -> list[dict]:
    return [json.loads(fs.read_text(f"{d}/report.json")) for d in run_dirs]


def _mean_std(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if not math.isnan(x)], np.float64)
    if not v.size:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def tau_tables(report: dict) -> dict[str, dict]:
    """{temperature: {method: {domain: τ}}} of one report: "0" (greedy) and each sampled."""
    sampled = report.get("tau_sampled", {})
    return {"0": report["tau"], **{t: v for t, v in sampled.items() if t != "0"}}


def _table(tables: list[dict]) -> dict:
    """One temperature's {"methods", "ratios", "lowest_cv", "lowest_cv_stage2"} over seeds."""
    methods = list(dict.fromkeys(m for r in tables for m in r))
    out = {"methods": {}, "ratios": []}
    per_seed = [summarise(r) for r in tables]
    for m in methods:
        domains = list(dict.fromkeys(d for r in tables for d in r.get(m, {})))
        out["methods"][m] = {
            "tau": _mean_std([s[m]["mean"] for s in per_seed if m in s]),
            "cv": _mean_std([s[m]["cv"] for s in per_seed if m in s]),
            "domains": {
                d: _mean_std([r[m][d] for r in tables if d in r.get(m, {})]) for d in domains
            },
        }
    for num, den, goal in RATIO_GOALS:
        if num not in methods or den not in methods:
            continue
        ratios = [s[num]["mean"] / s[den]["mean"] for s in per_seed if num in s and den in s]
        mean, std = _mean_std(ratios)
        met = bool(mean - std >= goal)
        out["ratios"].append(dict(num=num, den=den, goal=goal, mean=mean, std=std, met=met))
    cvs = {m: v["cv"][0] for m, v in out["methods"].items() if m != "stage1_long"}
    out["lowest_cv"] = min(cvs, key=cvs.get) if cvs else None
    cvs = {m: cv for m, cv in cvs.items() if m in STAGE2_OBJECTIVE}
    out["lowest_cv_stage2"] = min(cvs, key=cvs.get) if cvs else None
    return out


def _positions(reports: list[dict]) -> dict:
    """{method: {bucket: (mean, std) of τ}} over the reports that measured τ by position."""
    out = {}
    for r in reports:
        for m, v in r.get("tau_by_position", {}).items():
            for b, tau in v["tau"].items():
                out.setdefault(m, {}).setdefault(b, []).append(tau)
    return {m: {b: _mean_std(v) for b, v in per.items()} for m, per in out.items()}


def aggregate(reports: list[dict]) -> dict:
    """{"seeds", "temperatures": {t: one table}, "positions"}, plus the greedy table's
    "methods", "ratios" and "lowest_cv" at the top level."""
    by_t = [tau_tables(r) for r in reports]
    temps = list(dict.fromkeys(t for tables in by_t for t in tables))
    per_t = {t: _table([tables[t] for tables in by_t if t in tables]) for t in temps}
    out = {"seeds": len(reports), **per_t["0"], "temperatures": per_t}
    out["positions"] = _positions(reports)
    return out


def _method_table(table: dict) -> list[str]:
    methods = table["methods"]
    domains = list(dict.fromkeys(d for v in methods.values() for d in v["domains"]))
    lines = [
        "| method | " + " | ".join(domains) + " | mean τ | CV |",
        "|---" * (len(domains) + 3) + "|",
    ]
    for m, v in methods.items():
        cells = [_pm(v["domains"].get(d, (math.nan, math.nan))) for d in domains]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {_pm(v['tau'])} | {_pm(v['cv'])} |")
    lines.append("")
    for r in table["ratios"]:
        verdict = "met" if r["met"] else "not met"
        lines.append(
            f"- {r['num']} / {r['den']} mean τ: {r['mean']:.3f} ± {r['std']:.3f} "
            f"(goal ≥ {r['goal']:.2f} beyond the seed spread: {verdict})"
        )
    lines.append(f"- lowest cross-domain CV: {table['lowest_cv']}; of the stage-2 methods: "
                 f"{table['lowest_cv_stage2']}")  # fmt: skip
    return lines


def _pm(ms) -> str:
    return f"{ms[0]:.3f} ± {ms[1]:.3f}"


def markdown(agg: dict) -> str:
    """Per temperature the method table (τ per domain, mean τ and CV, mean ± std over seeds)
    and the goals; then τ by position when measured."""
    lines = []
    for t, table in agg["temperatures"].items():
        name = "greedy" if t == "0" else f"temperature {t}"
        lines += [f"{name} ({agg['seeds']} seeds):", "", *_method_table(table), ""]
    if agg["positions"]:
        buckets = list(dict.fromkeys(b for v in agg["positions"].values() for b in v))
        lines += ["τ by position (greedy):", "", "| method | " + " | ".join(buckets) + " |",
                  "|---" * (len(buckets) + 1) + "|"]  # fmt: skip
        for m, per in agg["positions"].items():
            cells = [_pm(per.get(b, (math.nan, math.nan))) for b in buckets]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines).rstrip()

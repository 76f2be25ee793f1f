"""Draft quality over seeds: τ of every method across several runs of the same recipe.

Each run's `report.json` holds τ per (method, domain). Per seed, a method scores its mean τ
over domains and its cross-domain CV (std / mean); over seeds we report mean ± sample std.
Method ratios (e.g. adaflash / sft) are paired per seed, so a seed that is easy for both
methods does not inflate the spread; a ratio goal is met "beyond the seed spread" when its
mean minus one std still clears it.
"""

from __future__ import annotations

import json
import math

import numpy as np

from adaflash_jax.distill.report import summarise
from adaflash_jax.io import fs

# (numerator, denominator, goal) of the issue-14 draft-quality goals
RATIO_GOALS = (("adaflash", "sft", 1.05), ("adaflash", "stage1_long", 1.10))


def load_reports(run_dirs) -> list[dict]:
    return [json.loads(fs.read_text(f"{d}/report.json")) for d in run_dirs]


def _mean_std(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if not math.isnan(x)], np.float64)
    if not v.size:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def aggregate(reports: list[dict]) -> dict:
    """{"methods": {m: {"tau", "cv", "domains"}}, "ratios": [...], "seeds": n}."""
    methods = list(dict.fromkeys(m for r in reports for m in r["tau"]))
    out = {"seeds": len(reports), "methods": {}, "ratios": []}
    per_seed = [summarise(r["tau"]) for r in reports]
    for m in methods:
        domains = list(dict.fromkeys(d for r in reports for d in r["tau"].get(m, {})))
        out["methods"][m] = {
            "tau": _mean_std([s[m]["mean"] for s in per_seed if m in s]),
            "cv": _mean_std([s[m]["cv"] for s in per_seed if m in s]),
            "domains": {
                d: _mean_std([r["tau"][m][d] for r in reports if d in r["tau"].get(m, {})])
                for d in domains
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
    return out


def markdown(agg: dict) -> str:
    """The method table (τ per domain, mean τ and CV, mean ± std over seeds) and the goals."""
    methods = agg["methods"]
    domains = list(dict.fromkeys(d for v in methods.values() for d in v["domains"]))
    pm = lambda ms: f"{ms[0]:.3f} ± {ms[1]:.3f}"  # noqa: E731
    lines = [
        "| method | " + " | ".join(domains) + " | mean τ | CV |",
        "|---" * (len(domains) + 3) + "|",
    ]
    for m, v in methods.items():
        cells = [pm(v["domains"].get(d, (math.nan, math.nan))) for d in domains]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {pm(v['tau'])} | {pm(v['cv'])} |")
    lines.append("")
    for r in agg["ratios"]:
        verdict = "met" if r["met"] else "not met"
        lines.append(
            f"- {r['num']} / {r['den']} mean τ: {r['mean']:.3f} ± {r['std']:.3f} "
            f"(goal ≥ {r['goal']:.2f} beyond the seed spread: {verdict})"
        )
    lines.append(f"- lowest cross-domain CV: {agg['lowest_cv']} (over {agg['seeds']} seeds)")
    return "\n".join(lines)

"""Benchmark outputs: the measured rows aggregated over domains (and, at concurrency 1, set
against their ideal speedup), then written as bench.json, a markdown report and PNG plots
(matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from adaflash_jax.io.cost_table import VerifyCostTable


def aggregate(rows: list[dict]) -> list[dict]:
    """Domain "all" rows per (label, concurrency): Σ tokens / Σ wall, step-weighted τ/width."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["domain"] != "all":
            groups.setdefault((r["label"], r["concurrency"]), []).append(r)
    out = []
    for rs in groups.values():
        steps = sum(r["verify_steps"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        agg = {
            k: rs[0][k]
            for k in ("method", "policy", "label", "concurrency", "block_size", "policy_options")
        }
        agg.update(
            domain="all",
            requests=sum(r["requests"] for r in rs),
            tokens=sum(r["tokens"] for r in rs),
            wall_s=wall,
            tokens_per_s=sum(r["tokens"] for r in rs) / wall,
            verify_steps=steps,
            loop_steps=sum(r["loop_steps"] for r in rs),
            committed=sum(r["committed"] for r in rs),
            tau=sum(r["committed"] for r in rs) / steps if steps else math.nan,
            mean_verify_width=sum(r["mean_verify_width"] * r["verify_steps"] for r in rs) / steps,
            mean_requested_width=sum(r["mean_requested_width"] * r["verify_steps"] for r in rs)
            / steps,
            mean_running=float(np.mean([r["mean_running"] for r in rs])),
            cut_fraction=sum(r["cut_fraction"] * r["verify_steps"] for r in rs) / steps,
            draft_fraction=sum(r["draft_fraction"] * r["verify_steps"] for r in rs) / steps,
            probes=sum(r["probes"] for r in rs),
            verified_tokens=sum(r["verified_tokens"] for r in rs),
            computed_tokens=sum(r["computed_tokens"] for r in rs),
            compiles_in_timed_pass=sum(r["compiles_in_timed_pass"] for r in rs),
            occupancy_exact=all(r["occupancy_exact"] for r in rs),
            matches_plain=all(r["matches_plain"] for r in rs),
        )
        if "policy_active_fraction" in rs[0]:
            w = [r["loop_steps"] for r in rs]
            agg["policy_active_fraction"] = float(
                np.average([r["policy_active_fraction"] for r in rs], weights=w)
            )
        out.append(agg)
    plain = {r["concurrency"]: r for r in out if r["method"] == "plain"}
    for r in out:
        r["ratio_to_plain"] = r["tokens_per_s"] / plain[r["concurrency"]]["tokens_per_s"]
    return out


def add_ideal_speedup(rows: list[dict], tables: dict[str, VerifyCostTable]) -> None:
    """At concurrency 1: ideal speedup τ · t_plain / (t_draft + t_verify(W̄)), with t_plain the
    measured plain step of the same cell (wall / loop steps, prefill included) and the draft
    and verify times from the drafter's cost table (W̄ = mean verify width, interpolated);
    and the measured ratio to plain as a fraction of it. The gap is what the engine spends
    per step beyond its loop step (prefill, scheduling, host round trips)."""
    plain = {r["domain"]: r for r in rows if r["method"] == "plain" and r["concurrency"] == 1}
    for r in rows:
        table = tables.get(r["method"])
        if r["concurrency"] != 1 or table is None or r["domain"] not in plain:
            continue
        p = plain[r["domain"]]
        t_plain = 1e3 * p["wall_s"] / max(p["loop_steps"], 1)
        col = [table.verify(1, w) for w in table.widths]
        t_verify = float(np.interp(r["mean_verify_width"], table.widths, col))
        # undrafted steps of a skip_draft policy pay no draft
        t_draft = r.get("draft_fraction", 1.0) * float(np.interp(1, table.rows, table.draft_ms))
        ideal = r["tau"] * t_plain / (t_draft + t_verify)
        r.update(
            ideal_speedup=ideal,
            fraction_of_ideal=r["ratio_to_plain"] / ideal,
            plain_step_ms=t_plain,
            draft_verify_ms=t_draft + t_verify,
            step_ms_measured=1e3 * r["wall_s"] / max(r["loop_steps"], 1),
        )


def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _labels(rows) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in rows))


def markdown(rows: list[dict], meta: dict) -> str:
    s = meta.get("settings", {})
    conc = sorted({r["concurrency"] for r in rows})
    all_rows = {(r["label"], r["concurrency"]): r for r in rows if r["domain"] == "all"}
    out = [
        f"# Throughput vs concurrency ({meta.get('backend')}: {meta.get('device')})",
        "",
        f"Greedy decoding (temperature {s.get('temperature')}), {s.get('max_new_tokens')} new "
        f"tokens per request, prompts cut to their last {s.get('max_prompt_len')} tokens, "
        f"{meta.get('prompts_per_domain')} prompts per domain cycled to at least "
        f"{s.get('requests_per_slot')}·c requests (column 'running': mean rows in flight); "
        f"cache capacity {meta.get('capacity')}; drafters {meta.get('drafters')}; adaflash "
        f"threshold {s.get('adaflash_threshold')}, goodput estimator "
        f"{s.get('goodput_estimator')}. Best of {s.get('repeats')} timed pass(es) after a "
        "warm-up pass. Wall time includes prefill and host scheduling.",
        "",
        "## All domains: output tokens/s (ratio to plain), τ, mean verify width",
        "",
        "| method | " + " | ".join(f"c={c}" for c in conc) + " |",
        "|---|" + "---|" * len(conc),
    ]
    for label in _labels(rows):
        cells = []
        for c in conc:
            r = all_rows.get((label, c))
            if r is None:
                cells.append("")
            elif r["method"] == "plain":
                cells.append(f"{r['tokens_per_s']:.1f}")
            else:
                drafted = r.get("draft_fraction", 1.0)
                probes = r.get("probes", 0) / max(r["loop_steps"], 1)
                cells.append(
                    f"{r['tokens_per_s']:.1f} ({r['ratio_to_plain']:.2f}x) "
                    f"τ {r['tau']:.2f} w {r['mean_verify_width']:.1f}"
                    + (f" d {drafted:.2f} p {probes:.3f}" if drafted < 1.0 else "")
                )
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += [
        "",
        "d: fraction of row-steps that drafted and verified (goodput's skip arm runs plain "
        "steps when drafting does not pay; shown when below 1); p: its probes (a drafter "
        "forward without a verify, refreshing the acceptance estimates) per loop step.",
    ]
    out += _adaflash_note(rows) + _ideal(rows) + _checks(rows)
    out += [
        "",
        "## Per domain",
        "",
        "| method | c | domain | tok/s | ratio | τ | width | requested | drafted | running "
        "| requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["domain"] == "all":
            continue
        out.append(
            f"| {r['label']} | {r['concurrency']} | {r['domain']} | {r['tokens_per_s']:.1f} | "
            f"{r['ratio_to_plain']:.2f} | {_fmt(r['tau'])} | {_fmt(r['mean_verify_width'])} | "
            f"{_fmt(r['mean_requested_width'])} | {_fmt(r.get('draft_fraction', 1.0))} | "
            f"{r['mean_running']:.1f} | {r['requests']} |"
        )
    return "\n".join(out) + "\n"


def _adaflash_note(rows) -> list[str]:
    ada = [r for r in rows if r["domain"] == "all" and "policy_active_fraction" in r]
    if not ada:
        return []
    out = ["", "## adaflash rule activity", ""]
    for r in ada:
        thr = r["policy_options"].get("threshold")
        out.append(
            f"- {r['label']} at c={r['concurrency']}: more than {thr} rows were running in "
            f"{100 * r['policy_active_fraction']:.0f}% of steps (the rule verifies the whole "
            f"block otherwise); {100 * r['cut_fraction']:.0f}% of row-steps asked for less "
            "than the block."
        )
    return out


def _ideal(rows) -> list[str]:
    ideal = [r for r in rows if r["domain"] == "all" and "ideal_speedup" in r]
    if not ideal:
        return []
    out = [
        "",
        "## Concurrency 1: achieved fraction of the ideal speedup",
        "",
        "ideal = τ · t_plain / (t_draft + t_verify(mean width)): t_plain the measured plain "
        "step (prefill included), t_draft + t_verify the engine's drafted loop step from the "
        "cost table measured on this device; the measured speculative step shows what "
        "scheduling, prefill and host round trips add.",
        "",
        "| method | τ | ratio to plain | ideal | fraction | plain step ms | draft+verify ms "
        "| measured step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ideal:
        out.append(
            f"| {r['label']} | {r['tau']:.2f} | {r['ratio_to_plain']:.2f} | "
            f"{r['ideal_speedup']:.2f} | {r['fraction_of_ideal']:.2f} | "
            f"{r['plain_step_ms']:.2f} | {r['draft_verify_ms']:.2f} | "
            f"{r['step_ms_measured']:.2f} |"
        )
    return out


def _checks(rows) -> list[str]:
    bad = [r for r in rows if r["domain"] != "all" and r["compiles_in_timed_pass"]]
    inexact = [r for r in rows if r["domain"] != "all" and not r["occupancy_exact"]]
    differ = [r for r in rows if r["domain"] != "all" and not r.get("matches_plain", True)]
    out = []
    if differ:
        out += ["", f"NOTE: {len(differ)} cells generated tokens that differ from plain decoding"
                " (expected only when sampling: temperature > 0)."]  # fmt: skip
    if bad:
        out += ["", f"WARNING: {len(bad)} cells compiled during their timed pass."]
    if inexact:
        out += ["", f"NOTE: occupancy reconstruction differs from the loop count in {len(inexact)}"
                " cells (running-row figures there are approximate)."]  # fmt: skip
    return out


def plot_throughput(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in _labels(rows):
        rs = sorted(
            (r for r in rows if r["label"] == label and r["domain"] == "all"),
            key=lambda r: r["concurrency"],
        )
        c = [r["concurrency"] for r in rs]
        ax1.plot(c, [r["tokens_per_s"] for r in rs], marker="o", label=label)
        ax2.plot(c, [r["ratio_to_plain"] for r in rs], marker="o", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (slots)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("output tokens/s (all domains)")
    ax2.set_ylabel("ratio to plain decoding")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tau(rows: list[dict], path: str) -> None:
    """τ per domain per speculative method (pooled over concurrencies, step-weighted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    spec = [r for r in rows if r["method"] != "plain" and r["domain"] != "all"]
    labels = _labels(spec)
    domains = list(dict.fromkeys(r["domain"] for r in spec))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(domains) + 2), 4))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        taus = []
        for d in domains:
            rs = [r for r in spec if r["label"] == label and r["domain"] == d]
            steps = sum(r["verify_steps"] for r in rs)
            taus.append(sum(r["committed"] for r in rs) / steps if steps else 0.0)
        ax.bar(np.arange(len(domains)) + i * width, taus, width, label=label)
    ax.set_xticks(np.arange(len(domains)) + width * (len(labels) - 1) / 2, domains)
    ax.set_ylabel("τ (accepted + 1 per verify step)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _atomic_json(path: str, obj, **kw) -> None:
    """A run killed mid-write (a time budget) leaves the previous complete file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, **kw)
    os.replace(path + ".tmp", path)


def write_outputs(result, out_dir: str) -> dict[str, str]:
    """bench.json (rows), bench_traces.json (meta, cost tables, traces), bench.md, PNGs."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "rows": os.path.join(out_dir, "bench.json"),
        "traces": os.path.join(out_dir, "bench_traces.json"),
        "markdown": os.path.join(out_dir, "bench.md"),
        "throughput_plot": os.path.join(out_dir, "throughput.png"),
        "tau_plot": os.path.join(out_dir, "tau.png"),
    }
    _atomic_json(paths["rows"], result.rows, indent=1)
    traces = {
        "format": "adaflash_jax.bench_traces/1",
        "encoding": "per request, one base-36 digit per verify step: accepted drafts; "
        "requested width (0 = an undrafted step) minus requested_offset",
        "meta": result.meta,
        "cost_tables": {n: t.to_json() for n, t in result.cost_tables.items()},
        "cells": result.traces,
    }
    _atomic_json(paths["traces"], traces)
    with open(paths["markdown"] + ".tmp", "w") as f:
        f.write(markdown(result.rows, result.meta))
    os.replace(paths["markdown"] + ".tmp", paths["markdown"])
    plot_throughput(result.rows, paths["throughput_plot"])
    plot_tau(result.rows, paths["tau_plot"])
    return paths

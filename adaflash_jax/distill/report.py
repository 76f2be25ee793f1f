"""The run's closing report: τ table, report.json, PNG plots (τ per domain; loss curves).

τ spread across domains is summarised by the coefficient of variation, CV = std / mean
(population std over the domains), so "higher mean, lower spread" reads off two columns.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np

from adaflash_jax.io import fs


def summarise(tau: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """{method: {"mean", "cv"}} over domains."""
    out = {}
    for method, per_domain in tau.items():
        v = np.array([x for x in per_domain.values() if not math.isnan(x)], np.float64)
        mean = float(v.mean()) if v.size else math.nan
        cv = float(v.std() / mean) if v.size and mean else math.nan
        out[method] = {"mean": mean, "cv": cv}
    return out


def table(tau: dict[str, dict[str, float]]) -> str:
    """A fixed-width table: one row per method, τ per domain, mean and CV."""
    domains = list(dict.fromkeys(d for per in tau.values() for d in per))
    stats = summarise(tau)
    head = ["method", *domains, "mean", "CV"]
    rows = [head]
    for method, per in tau.items():
        cells = [f"{per.get(d, math.nan):.3f}" for d in domains]
        rows.append([method, *cells, f"{stats[method]['mean']:.3f}", f"{stats[method]['cv']:.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    fs.write_text(path, json.dumps(report, indent=2, default=_plain))


def _save(fig, path: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    fs.write_bytes(path, buf.getvalue())


def _plain(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def plot_tau(path: str, tau: dict[str, dict[str, float]], sampled: dict | None = None) -> None:
    """τ per domain and method: greedy, then one panel per sampling temperature of `sampled`
    ({temperature: {method: {domain: τ}}}; its "0" is the greedy panel, not drawn twice)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("greedy", tau)]
    panels += [(f"temperature {t}", table) for t, table in (sampled or {}).items() if t != "0"]
    domains = list(dict.fromkeys(d for per in tau.values() for d in per)) + ["mean"]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(1.6 * len(domains) + 2, 4 * len(panels)), squeeze=False
    )
    for ax, (name, table) in zip(axes[:, 0], panels):
        _tau_panel(ax, table, domains, name)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _tau_panel(ax, tau: dict[str, dict[str, float]], domains: list[str], name: str) -> None:
    stats = summarise(tau)
    width = 0.8 / max(len(tau), 1)
    for i, (method, per) in enumerate(tau.items()):
        values = [per.get(d, math.nan) for d in domains[:-1]] + [stats[method]["mean"]]
        x = np.arange(len(domains)) + (i - (len(tau) - 1) / 2) * width
        ax.bar(x, values, width, label=f"{method} (CV {stats[method]['cv']:.2f})")
    ax.set_xticks(np.arange(len(domains)), domains)
    ax.set_ylabel("τ (tokens per verify step)")
    ax.set_title(f"Acceptance length per domain, {name}")
    ax.legend()


def extra_summaries(extra: dict) -> dict:
    """report.json's optional τ entries (`distill.evaluation.extra_evaluations`) with, for
    sampled τ, {temperature: {method: {"mean", "cv"}}} as "summary_sampled"."""
    out = dict(extra)
    if "tau_sampled" in extra:
        out["summary_sampled"] = {t: summarise(v) for t, v in extra["tau_sampled"].items()}
    return out


def position_table(by_method: dict[str, dict]) -> str:
    """One row per method: τ per position bucket (steps in brackets)."""
    buckets = list(dict.fromkeys(b for v in by_method.values() for b in v["tau"]))
    rows = [["method", *buckets]]
    for method, v in by_method.items():
        rows.append([method, *(f"{v['tau'][b]:.3f} ({v['steps'][b]})" for b in buckets)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


CALIBRATION_COLUMNS = ("blocks", "mse", "predicted_len", "realised_len", "corr", "width_exact",
                       "width_covers")  # fmt: skip


def calibration_table(points: dict[str, dict]) -> str:
    """One row per calibration point (distill/calibration.py): the pooled entries."""
    rows = [["point", *CALIBRATION_COLUMNS]]
    for point, entry in points.items():
        cells = [f"{entry.get(c, math.nan):.3f}" for c in CALIBRATION_COLUMNS[1:]]
        rows.append([point, str(entry.get("blocks", 0)), *cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def extra_tables(extra: dict) -> str:
    """The printed form of the optional entries ("" when there are none)."""
    out = ""
    if extra.get("head_calibration"):
        out += "\nlength head calibration (held-out blocks)\n"
        out += f"{calibration_table(extra['head_calibration'])}\n"
    for t, table_t in extra.get("tau_sampled", {}).items():
        if t != "0":
            out += f"\nτ at temperature {t} (sampled, seeded)\n{table(table_t)}\n"
    if "tau_by_position" in extra:
        long = extra["long_set"]
        out += (
            f"\nτ by block position (greedy, {long['prompts']} long prompts, "
            f"{long['new_tokens']} new tokens; steps)\n{position_table(extra['tau_by_position'])}\n"
        )
    return out


def plot_losses(path: str, scalars: dict[str, list[tuple[int, float]]]) -> None:
    """One panel per stage: its loss parts against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = ("loss", "ce", "kl_clipped", "head_mse")
    order = {"stage1": 0, "head_init": 1}
    stages = {t.split("/")[0] for t in scalars if t.split("/")[-1] in wanted}
    stages = sorted(stages, key=lambda s: (order.get(s, 2), s))
    if not stages:
        return
    fig, axes = plt.subplots(1, len(stages), figsize=(4.5 * len(stages), 3.6), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        for part in wanted:
            points = sorted(scalars.get(f"{stage}/{part}", []))
            if points:
                ax.plot(*zip(*points), label=part)
        ax.set_title(stage)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)

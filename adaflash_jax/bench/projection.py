"""PROJECTED throughput vs concurrency from measured acceptance and a step-cost model.

Names: B concurrency (rows per step, saturated), K block size, W verify width, A accepted
drafts of a row-step at the full block, w a row's requested width, b a bucket.

Not a measurement: it combines acceptance measured with our small drafters (bench traces)
with step costs measured elsewhere (e.g. the Qwen3-8B shape on one H200). Per method, output
tokens/s at B = 1000 · B · E[committed per row-step] / E[step ms]:
- plain: committed 1, step = verify(B, 1).
- DRAFTER/fixed at width W: committed min(A, W−1) + 1 (greedy acceptance is a prefix test,
  so a narrower verify keeps the prefix of the full-block outcome), step = draft(B) +
  verify(B, W). W = K is DFlash.
- DRAFTER/goodput (best static width): the W maximising the above per B. A stand-in for the
  per-step goodput policy with a calibrated acceptance estimate; the real policy adapts per
  step (can do better) and estimates acceptance (can do worse).
- DRAFTER/adaflash: above `threshold` running rows, each row asks for w (recorded while the
  rule was active) and commits its recorded accepted + 1; the batch runs at the smallest
  bucket >= the largest request, so E[verify] = Σ_b P(bucket = b) · verify(B, b) with
  P(max of B requests <= x) = F(x)^B (F: the empirical distribution of w). At or below the
  threshold the rule is off: the full-block projection of the same drafter.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from adaflash_jax.bench.cost_model import CostModel
from adaflash_jax.bench.occupancy import decode_trace, occupancy, running_per_step
from adaflash_jax.io.cost_table import FORMAT


@dataclasses.dataclass
class Acceptance:
    """Pooled row-steps of one drafter: full-block accepted counts; active-rule pairs."""

    block_size: int
    buckets: tuple[int, ...]
    full_accepted: np.ndarray  # A per row-step under the fixed full-block policy
    rule_requested: np.ndarray  # w per row-step while the adaflash rule was active
    rule_accepted: np.ndarray
    sources: list[str]
    policies: set[str] = dataclasses.field(default_factory=set)  # the benchmark ran these


def load_acceptance(path: str, *, domain: str | None = None) -> dict[str, Acceptance]:
    """{drafter name: Acceptance} from bench_traces.json (goodput cells are skipped: their
    widths were chosen with the measuring device's costs)."""
    with open(path) as f:
        data = json.load(f)
    out: dict[str, Acceptance] = {}
    for cell in data["cells"]:
        if domain is not None and cell["domain"] != domain:
            continue
        acc = out.setdefault(
            cell["method"],
            Acceptance(
                cell["block_size"],
                tuple(cell["buckets"]),
                np.zeros(0, np.int64),
                np.zeros(0, np.int64),
                np.zeros(0, np.int64),
                [],
            ),
        )
        if cell["block_size"] != acc.block_size:
            raise ValueError(f"drafter {cell['method']!r} appears with two block sizes")
        acc.policies.add(cell["policy"])
        accepted = [decode_trace(t) for t in cell["accepted"]]
        if cell["policy"] == "fixed":
            flat = np.asarray([a for req in accepted for a in req], np.int64)
            acc.full_accepted = np.concatenate([acc.full_accepted, flat])
            acc.sources.append(f"{cell['label']} c={cell['concurrency']} {cell['domain']}")
        elif cell["policy"] == "adaflash":
            # traces before the skip arm stored requested widths minus 1 (no zeros then)
            offset = cell.get("requested_offset", 1)
            requested = [decode_trace(t, offset=offset) for t in cell["requested"]]
            steps = [len(r) for r in accepted]
            running = running_per_step(steps, cell["concurrency"])
            starts, _ = occupancy(steps, cell["concurrency"])
            thr = cell["policy_options"].get("threshold", 48)
            for s0, req, a in zip(starts, requested, accepted):
                active = running[s0 : s0 + len(a)] > thr
                acc.rule_requested = np.concatenate([acc.rule_requested, np.asarray(req)[active]])
                acc.rule_accepted = np.concatenate([acc.rule_accepted, np.asarray(a)[active]])
            if len(acc.rule_requested):
                acc.sources.append(f"{cell['label']} c={cell['concurrency']} {cell['domain']}")
    return out


def cost_source(path: str) -> str:
    """How the projection's header names a cost file: a cost table (measured on a device, or a
    TPU table of compiler estimates from `experiments.tpu_compile --serve`) by the device and
    shapes it records, any other file by its path."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return path
    model = f"; {data['model']}" if data.get("model") else ""
    return f"{path} ({data.get('device', 'unknown device')}{model})"


def plain_tps(cost: CostModel, b: int) -> float:
    return 1e3 * b / cost.verify(b, 1)


def fixed_tps(cost: CostModel, b: int, full_accepted: np.ndarray, w: int) -> tuple[float, float]:
    """(tokens/s, τ) verifying width w every step."""
    tau = float(np.mean(np.minimum(full_accepted, w - 1) + 1))
    return 1e3 * b * tau / (cost.draft(b) + cost.verify(b, w)), tau


def rule_tps(cost: CostModel, b: int, requested, accepted, buckets) -> tuple[float, float, float]:
    """(tokens/s, τ, expected bucket) of per-row requests w, batch bucket >= max over b rows."""
    requested = np.asarray(requested)
    cdf = np.array([np.mean(requested <= x) for x in buckets])
    p_max = np.diff(np.concatenate([[0.0], cdf**b]))  # P(bucket = buckets[j])
    verify = sum(p * cost.verify(b, w) for p, w in zip(p_max, buckets))
    tau = float(np.mean(np.asarray(accepted) + 1))
    return 1e3 * b * tau / (cost.draft(b) + verify), tau, float(np.dot(p_max, buckets))


def packed_rule_tps(
    cost: CostModel, b: int, requested, accepted, *, draws: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """(tokens/s, τ, mean tokens per row) of per-row requests w under packed verify: the
    step runs the smallest token bucket b·f >= Σ w over b requests (the largest if none)."""
    fills = np.asarray(cost.packed_fills(b))
    sums = np.random.default_rng(seed).choice(np.asarray(requested), size=(draws, b)).sum(1)
    at = np.minimum(np.searchsorted(b * fills, sums), len(fills) - 1)
    verify_F = np.asarray([cost.packed(b, int(f)) for f in fills])
    tau = float(np.mean(np.asarray(accepted) + 1))
    verify = float(np.mean(verify_F[at]))
    return 1e3 * b * tau / (cost.draft(b) + verify), tau, float(np.mean(sums) / b)


def project(
    cost: CostModel,
    acceptance: dict[str, Acceptance],
    concurrencies,
    *,
    threshold: int = 48,
) -> list[dict]:
    rows = []

    def add(b, plain, method, policy, tps, tau, width, note=""):
        label = f"{method}/{policy}" if policy else method
        rows.append(
            dict(method=method, policy=policy, label=label, concurrency=b, tokens_per_s=tps,
                 ratio_to_plain=tps / plain, tau=tau, verify_width=width, note=note)
        )  # fmt: skip

    for b in concurrencies:
        plain = plain_tps(cost, b)
        add(b, plain, "plain", None, plain, 1.0, 1)
        for name, acc in acceptance.items():
            if not len(acc.full_accepted):
                continue
            k = acc.block_size
            full, tau_full = fixed_tps(cost, b, acc.full_accepted, k)
            add(b, plain, name, "fixed", full, tau_full, k)
            if "goodput" in acc.policies:
                # the policy's arms: every drafted width, or an undrafted (plain) step
                options = [(fixed_tps(cost, b, acc.full_accepted, w), w) for w in acc.buckets]
                (best, tau_best), w_best = max(options, key=lambda o: (o[0][0], -o[1]))
                if plain >= best:
                    add(b, plain, name, "goodput", plain, 1.0, 1, "plain arm (no drafting)")
                else:
                    add(b, plain, name, "goodput", best, tau_best, w_best, "best static width")
            if "adaflash" not in acc.policies:
                continue
            if b <= threshold:
                add(
                    b,
                    plain,
                    name,
                    "adaflash",
                    full,
                    tau_full,
                    k,
                    f"rule off at <= {threshold} rows",
                )
            elif len(acc.rule_requested):
                tps, tau, width = rule_tps(
                    cost, b, acc.rule_requested, acc.rule_accepted, acc.buckets
                )
                add(b, plain, name, "adaflash", tps, tau, width, "expected bucket")
                if cost.packed_fills(b):
                    tps, tau, width = packed_rule_tps(
                        cost, b, acc.rule_requested, acc.rule_accepted
                    )
                    add(b, plain, name, "adaflash-packed", tps, tau, width, "mean tokens/row")
    return rows


def markdown(rows: list[dict], header: list[str]) -> str:
    conc = sorted({r["concurrency"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cell = {(r["label"], r["concurrency"]): r for r in rows}
    out = header + [
        "",
        "| method | " + " | ".join(f"B={c}" for c in conc) + " |",
        "|---|" + "---|" * len(conc),
    ]
    for label in labels:
        cells = []
        for c in conc:
            r = cell.get((label, c))
            if r is None:
                cells.append("")
            elif r["method"] == "plain":
                cells.append(f"{r['tokens_per_s']:.0f}")
            else:
                cells.append(
                    f"{r['tokens_per_s']:.0f} ({r['ratio_to_plain']:.2f}x) τ {r['tau']:.2f} "
                    f"W {r['verify_width']:.1f}"
                )
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"

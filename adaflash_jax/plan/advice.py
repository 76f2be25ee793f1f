"""Which knob to turn when a plan does not fit, and which mesh to pick for a slice.

Every suggestion is a re-run of `estimate` with one knob changed, so the advice states the
resulting peak rather than a rule of thumb. It names only knobs the run config has: mesh,
num_anchors, batch_size, stage2.collect_slots, loss_chunk and train_attention (the planner's
`logits_chunk` and `attention`); the planner's `remat` has no trainer knob, so it is never
advised.
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.aot.chips import CHIP_HBM_GIB
from adaflash_jax.model.config import ConfigError
from adaflash_jax.plan.inputs import PlanInputs
from adaflash_jax.plan.memory_estimate import GIB, MemoryPlan, estimate


@dataclasses.dataclass(frozen=True)
class Suggestion:
    knob: str
    change: str
    peak_bytes: int


def mesh_candidates(inp: PlanInputs, devices: int) -> list[tuple[int, int, int]]:
    """(data, fsdp, tensor) factorizations of `devices` the batch can be split over; tensor
    only up to the query heads and only where it divides them."""
    out = []
    heads = inp.target.num_attention_heads
    for t in range(1, devices + 1):
        if devices % t or heads % t:
            continue
        for f in range(1, devices // t + 1):
            if (devices // t) % f:
                continue
            d = devices // (t * f)
            shards = d * f
            if inp.batch_size % shards or inp.slots % shards:
                continue
            out.append((d, f, t))
    return out


def choose_mesh(inp: PlanInputs, devices: int, hbm_bytes: float, headroom: float = 0.1):
    """The fitting mesh with the smallest tensor axis, then the most data parallelism (fewest
    collectives); if nothing fits, the mesh with the lowest peak. Returns (plan, fits)."""
    best = None
    for mesh in mesh_candidates(inp, devices):
        plan = estimate(inp.replace(mesh=mesh))
        fits = plan.fits(hbm_bytes, headroom)
        key = (not fits, mesh[2], -mesh[0], plan.peak_bytes) if fits else (True, plan.peak_bytes)
        if best is None or key < best[0]:
            best = (key, plan, fits)
    if best is None:
        raise ConfigError(
            f"no (data, fsdp, tensor) mesh of {devices} devices divides batch_size "
            f"{inp.batch_size} and collect_slots {inp.slots}"
        )
    return best[1], best[2]


def _halvings(value: int, floor: int = 1):
    v = value // 2
    while v >= floor:
        yield v
        v //= 2


def suggest(plan: MemoryPlan, hbm_bytes: float, headroom: float = 0.1) -> list[Suggestion]:
    """Single-knob changes that make `plan` fit, least disruptive first."""
    inp = plan.inputs
    out: list[Suggestion] = []

    def first_fit(knob: str, values, make, describe):
        for v in values:
            try:
                cand = estimate(make(v))
            except ConfigError:
                continue
            if cand.fits(hbm_bytes, headroom):
                out.append(Suggestion(knob, describe(v), cand.peak_bytes))
                return

    for mesh in mesh_candidates(inp, inp.devices):
        if mesh == inp.mesh:
            continue
        cand = estimate(inp.replace(mesh=mesh))
        if cand.fits(hbm_bytes, headroom):
            out.append(Suggestion("mesh", f"mesh {inp.mesh} -> {mesh}", cand.peak_bytes))
    out.sort(key=lambda s: s.peak_bytes)
    del out[3:]  # the three roomiest meshes are enough
    n = inp.num_anchors
    chunk = inp.logits_chunk or n
    first_fit(
        "loss_chunk",
        _halvings(chunk),
        lambda v: inp.replace(logits_chunk=v),
        lambda v: f"loss_chunk {chunk} -> {v} (blocks whose logits are live at once)",
    )
    first_fit(
        "num_anchors",
        _halvings(n),
        lambda v: inp.replace(num_anchors=v),
        lambda v: f"num_anchors {n} -> {v}",
    )
    first_fit(
        "batch_size",
        _halvings(inp.batch_size, inp.batch_shards),
        lambda v: inp.replace(batch_size=v, collect_slots=min(inp.slots, v)),
        lambda v: f"batch_size {inp.batch_size} -> {v}",
    )
    first_fit(
        "collect_slots",
        _halvings(inp.slots, inp.collect_shards),
        lambda v: inp.replace(collect_slots=v),
        lambda v: f"collect_slots {inp.slots} -> {v}",
    )
    if inp.attention == "naive":
        first_fit(
            "train_attention",
            ["fused"],
            lambda v: inp.replace(attention=v),
            lambda v: "train_attention='sparse' (no dense block-to-context scores)",
        )
    return out


def format_advice(plan: MemoryPlan, hbm_gib: float, headroom: float = 0.1) -> str:
    if plan.fits(hbm_gib * GIB, headroom):
        return "the plan fits; no change needed"
    found = suggest(plan, hbm_gib * GIB, headroom)
    if not found:
        worst = max(plan.terms, key=lambda t: t.bytes)
        return (
            "no single knob makes this fit; the largest term is "
            f"'{worst.name}' ({worst.bytes / GIB:.1f} GiB): use more devices, or change "
            "several knobs at once (mesh, batch_size, num_anchors, collect_slots, loss_chunk)"
        )
    lines = ["does not fit; each of these single changes would:"]
    lines += [f"  - {s.change}: peak {s.peak_bytes / GIB:.2f} GiB" for s in found]
    return "\n".join(lines)


# Common single-slice shapes: (accelerator type, chip kind, chips). A v5p type counts
# TensorCores (two per chip); v5e (v5litepod) and v6e types count chips.
SLICES = (
    ("v5p-8", "v5p", 4),
    ("v5p-16", "v5p", 8),
    ("v5p-32", "v5p", 16),
    ("v5p-64", "v5p", 32),
    ("v5p-128", "v5p", 64),
    ("v5litepod-8", "v5e", 8),
    ("v5litepod-16", "v5e", 16),
    ("v5litepod-32", "v5e", 32),
    ("v5litepod-64", "v5e", 64),
    ("v5litepod-256", "v5e", 256),
    ("v6e-8", "v6e", 8),
    ("v6e-16", "v6e", 16),
    ("v6e-32", "v6e", 32),
    ("v6e-64", "v6e", 64),
)


def slice_table(workload: PlanInputs, targets: dict, headroom: float = 0.1, slices=SLICES) -> str:
    """Markdown: the mesh `choose_mesh` picks for each target on each slice in SLICES, with
    one sequence per chip (global batch = chips) and `workload`'s other knobs."""
    head = "| slice | chips | HBM/chip |"
    rule = "|---|---|---|"
    for name in targets:
        head += f" {name}: mesh (data, fsdp, tensor) | peak GiB |"
        rule += "---|---|"
    rows = [head, rule]
    for accel, chip, chips in slices:
        hbm = CHIP_HBM_GIB[chip]
        row = f"| {accel} | {chips} | {hbm:g} GiB |"
        for target in targets.values():
            inp = workload.replace(
                target=target,
                drafter=dataclasses.replace(
                    workload.drafter,
                    hidden_size=target.hidden_size,
                    intermediate_size=target.intermediate_size,
                    num_attention_heads=target.num_attention_heads,
                    num_key_value_heads=target.num_key_value_heads,
                    head_dim=target.head_dim,
                ),
                mesh=(1, chips, 1),
                batch_size=chips,
                collect_slots=None,
            )
            plan, fits = choose_mesh(inp, chips, hbm * GIB, headroom)
            mesh = str(plan.inputs.mesh) if fits else "does not fit"
            row += f" {mesh} | {plan.peak_bytes / GIB:.1f} |"
        rows.append(row)
    return "\n".join(rows)

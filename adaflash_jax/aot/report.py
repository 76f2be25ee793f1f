"""Compile a Program for a TPU slice and read the compiler's figures: per-chip HBM, FLOPs,
bytes and XLA's estimated step time, and from them MFU and tokens/s/chip (train steps) or
the estimate against the weight-read floor (decode programs). Every figure is a COMPILER
ESTIMATE, not a measurement.

What each figure is, and what the report corrects in XLA's (custom calls costed at −1 s,
loop bodies counted once, the `no_msa` second compile): docs/design.md §7d.
"""

from __future__ import annotations

import dataclasses
import json
import time

from adaflash_jax.aot import flops as flops_doc
from adaflash_jax.aot.chips import GIB, Chip
from adaflash_jax.aot.kernels import uncosted_kernels
from adaflash_jax.aot.program import Program

FORMAT = "adaflash_jax.tpu_compile/1"
LABEL = "compiler estimates (deviceless XLA compile for TPU; not measurements)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Figures:
    program: str
    kind: str
    hbm_bytes: int  # the chip's
    chips: int
    compiled: bool
    error: str | None = None
    compile_s: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    generated_code_bytes: int = 0
    flops: float = 0.0  # per chip
    bytes_accessed: float = 0.0  # per chip
    optimal_seconds: float = 0.0  # XLA's + −1 s custom calls + left-out loop FLOPs at peak
    xla_optimal_seconds: float = 0.0  # as cost_analysis() reported it
    concat_bitcasts: int = 0  # ConcatBitcast custom calls in the compiled program
    triangular_inversions: int = 0  # InvertDiagBlocksLowerTriangular custom calls (ditto)
    no_msa_bytes_accessed: float = 0.0  # per chip, compiled without memory-space assignment
    no_msa_seconds: float = 0.0  # its estimate (the same custom-call correction); 0: not asked
    loop_flops: float = 0.0  # per chip: loop iterations the cost analysis left out (added)
    useful_flops: float = 0.0  # per chip (train)
    tokens: int = 0  # per step, whole slice (train)
    weight_bytes: int = 0  # per chip (decode)
    floor_seconds: float = 0.0  # weight bytes / HBM bandwidth (decode)
    bf16_peak: float = 0.0
    rows: int = 0
    width: int = 0
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        out = self.argument_bytes + self.output_bytes - self.alias_bytes
        return out + self.temp_bytes + self.generated_code_bytes

    @property
    def fits(self) -> bool:
        return self.compiled and self.total_bytes <= self.hbm_bytes

    @property
    def headroom(self) -> float:
        return 1.0 - self.total_bytes / self.hbm_bytes

    @property
    def mfu(self) -> float | None:
        if self.kind != "train" or not self.optimal_seconds:
            return None
        return self.useful_flops / (self.optimal_seconds * self.bf16_peak)

    @property
    def tokens_per_s_per_chip(self) -> float | None:
        if self.kind != "train" or not self.optimal_seconds:
            return None
        return self.tokens / (self.optimal_seconds * self.chips)

    @property
    def vs_floor(self) -> float | None:
        if self.kind != "decode" or not self.floor_seconds or not self.optimal_seconds:
            return None
        return self.optimal_seconds / self.floor_seconds

    @property
    def no_msa_vs_floor(self) -> float | None:
        if self.kind != "decode" or not self.floor_seconds or not self.no_msa_seconds:
            return None
        return self.no_msa_seconds / self.floor_seconds

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            no_msa_over_floor=self.no_msa_vs_floor,
            total_bytes=self.total_bytes,
            fits=self.fits,
            headroom=self.headroom if self.compiled else None,
            mfu=self.mfu,
            tokens_per_s_per_chip=self.tokens_per_s_per_chip,
            estimated_over_floor=self.vs_floor,
        )
        return out


NO_MSA = {"xla_msa_enable": False}  # libtpu's switch for memory-space assignment


def _estimate(compiled, loop_flops: float, peak: float):
    """(cost dict, XLA's optimal_seconds, ConcatBitcasts, triangular inversions, the corrected
    estimate) of one compiled program."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per device program
        cost = cost[0] if cost else {}
    raw = float(cost.get("optimal_seconds", 0.0))
    text = compiled.as_text() if raw < 0 else ""
    concats = text.count('custom_call_target="ConcatBitcast"')
    inversions = text.count('custom_call_target="InvertDiagBlocksLowerTriangular"')
    est = raw + concats + inversions
    est = est + loop_flops / peak if est >= 0 else float("nan")
    return cost, raw, concats, inversions, est


def compile_program(p: Program, chip: Chip, chips: int, *, no_msa: bool = False) -> Figures:
    """Lowers and compiles `p`; a refusal (e.g. HBM exceeded) is recorded, not raised.
    `no_msa` (decode programs): also the estimate without memory-space assignment."""
    base = dict(
        program=p.name,
        kind=p.kind,
        hbm_bytes=chip.hbm_bytes,
        chips=chips,
        useful_flops=p.useful_flops / chips,
        loop_flops=p.loop_flops / chips,
        tokens=p.tokens,
        weight_bytes=p.weight_bytes,
        floor_seconds=p.weight_bytes / chip.hbm_bandwidth,
        bf16_peak=chip.bf16_peak,
        rows=p.rows,
        width=p.width,
        notes=p.notes,
    )
    t0 = time.perf_counter()
    try:
        lowered = p.lower()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 — XlaRuntimeError; the message is the finding
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Figures(
            compiled=False, error=first[:400], compile_s=time.perf_counter() - t0, **base
        )
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost, raw, concats, inversions, est = _estimate(compiled, base["loop_flops"], chip.bf16_peak)
    extra = {}
    if no_msa and p.kind == "decode":
        try:
            plain = lowered.compile(compiler_options=NO_MSA)
        except Exception as e:  # noqa: BLE001 — e.g. a libtpu without that option
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            base["notes"] = (*p.notes, f"no-MSA compile refused: {first[:200]}")
        else:
            cost2, *_, est2 = _estimate(plain, base["loop_flops"], chip.bf16_peak)
            extra = dict(
                no_msa_bytes_accessed=float(cost2.get("bytes accessed", 0.0)),
                no_msa_seconds=est2,
            )
        seconds = time.perf_counter() - t0
    return Figures(
        compiled=True,
        compile_s=seconds,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        generated_code_bytes=int(mem.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)) + base["loop_flops"],
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=est,
        xla_optimal_seconds=raw,
        concat_bitcasts=concats,
        triangular_inversions=inversions,
        **extra,
        **base,
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.3g}"


def table(figs: list[Figures], chip: Chip) -> str:
    """Markdown table, one row per program (every figure a compiler estimate); a last column
    with the estimates without memory-space assignment when any program has them."""
    no_msa = any(f.no_msa_seconds for f in figs)
    head = (
        "| program | args | outputs | aliased | temps | code | total GiB/chip | "
        f"fits {chip.hbm_gib:g} GiB (headroom) | TFLOP/chip | GB accessed/chip | est. ms | "
        "MFU / est. vs floor | tokens/s/chip |"
    )
    cols = 13
    if no_msa:
        head += " no MSA: GB accessed/chip, est. ms, vs floor |"
        cols += 1
    rows = [head, "|---" * cols + "|"]
    for f in figs:
        if not f.compiled:
            rows.append(f"| {f.program} | refused: {f.error} |" + " |" * (cols - 2))
            continue
        verdict = f"{'yes' if f.fits else 'NO'} ({f.headroom:.0%})"
        if f.kind == "train":
            ratio = f"MFU {f.mfu:.1%}" if f.mfu is not None else ""
            tps = f"{f.tokens_per_s_per_chip:,.0f}" if f.tokens_per_s_per_chip else ""
        else:
            ratio = f"{f.vs_floor:.2f}x floor {1e3 * f.floor_seconds:.2f} ms" if f.vs_floor else ""
            tps = ""
        rows.append(
            f"| {f.program} | {_gib(f.argument_bytes)} | {_gib(f.output_bytes)} | "
            f"{_gib(f.alias_bytes)} | {_gib(f.temp_bytes)} | {_gib(f.generated_code_bytes)} | "
            f"{_gib(f.total_bytes)} | {verdict} | {f.flops / 1e12:.3g} | "
            f"{f.bytes_accessed / 1e9:.3g} | {1e3 * f.optimal_seconds:.3g}"
            f"{'*' if f.concat_bitcasts + f.triangular_inversions else ''}"
            f"{'+' if f.loop_flops else ''} | {ratio} | {tps} |"
            + (f" {_no_msa_cell(f)} |" if no_msa else "")
        )
    if any(f.concat_bitcasts + f.triangular_inversions for f in figs):
        rows.append(
            "\n* XLA's estimate counted each ConcatBitcast and InvertDiagBlocksLowerTriangular "
            "(triangular_solve) custom call of the program as -1 s; those seconds are added back "
            "(report.py)"
        )
    if any(f.loop_flops for f in figs):
        rows.append(
            "\n+ includes the loop iterations XLA's cost analysis counts once (chunked loss, "
            "sparse attention), added at the chip's bf16 peak (flops.loop_flops_left_out)"
        )
    return "\n".join(rows)


def _no_msa_cell(f: Figures) -> str:
    if not f.no_msa_seconds:
        return ""
    ratio = f", {f.no_msa_vs_floor:.2f}x" if f.no_msa_vs_floor else ""
    return f"{f.no_msa_bytes_accessed / 1e9:.3g}, {1e3 * f.no_msa_seconds:.3g}{ratio}"


def header(slice_desc: str, chip: Chip, mesh: dict, extra: list[str] | None = None) -> list[str]:
    kernels = uncosted_kernels()
    return [
        f"# {slice_desc}: {LABEL}",
        f"chip {chip.name}: {chip.hbm_gib:g} GiB HBM, {chip.hbm_bandwidth / 1e9:,.0f} GB/s, "
        f"{chip.bf16_peak / 1e12:g} bf16 TFLOP/s ({chip.source}); mesh {mesh}",
        "custom kernels left out of the cost estimate: " + (", ".join(kernels) or "none"),
        *(extra or []),
    ]


def to_json(figs: list[Figures], **meta) -> dict:
    return {
        "format": FORMAT,
        "label": LABEL,
        "uncosted_kernels": uncosted_kernels(),
        "useful_flops": flops_doc.__doc__.strip(),
        **meta,
        "programs": [f.to_json() for f in figs],
    }


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)

"""Cloud TPU chip facts in ONE table: HBM size and bandwidth, bf16 peak, chips per host.

Source: Google's TPU architecture pages, key-specification tables (checked 2026):
- v5e: https://cloud.google.com/tpu/docs/v5e — 197 bf16 TFLOP/s, HBM2 16 GB at 819 GB/s; VMs
  of 1, 4 or 8 chips (multi-host training slices: 8 per host).
- v5p: https://cloud.google.com/tpu/docs/v5p — 459 bf16 TFLOP/s, HBM2e 95 GB at 2,765 GB/s;
  2 TensorCores per chip (accelerator types count cores: v5p-64 = 32 chips); 4 chips per host.
  The page notes the 95 is GiB the runtime leaves to programs (96 GiB physical).
- v6e: https://cloud.google.com/tpu/docs/v6e — 918 bf16 TFLOP/s, 32 GB HBM at 1,638 GB/s
  (older copies of the page round it to 1,640); 8 chips per host.

HBM sizes are read as GiB (as the compiler counts them: it reports 95.74 GiB available on a
v5p chip); bandwidths and peaks are decimal (GB/s = 1e9 B/s, TFLOP/s = 1e12 FLOP/s).
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.model.config import ConfigError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    name: str  # "v5e" | "v5p" | "v6e"
    hbm_gib: float  # per chip, as documented
    hbm_bandwidth: float  # bytes/s per chip
    bf16_peak: float  # FLOP/s per chip
    chips_per_host: int
    cores_per_chip: int  # TensorCores: what a v5p accelerator-type number counts
    source: str

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * GIB)


CHIPS: dict[str, Chip] = {
    "v5e": Chip(
        name="v5e",
        hbm_gib=16.0,
        hbm_bandwidth=819e9,
        bf16_peak=197e12,
        chips_per_host=8,
        cores_per_chip=1,
        source="https://cloud.google.com/tpu/docs/v5e",
    ),
    "v5p": Chip(
        name="v5p",
        hbm_gib=95.0,
        hbm_bandwidth=2765e9,
        bf16_peak=459e12,
        chips_per_host=4,
        cores_per_chip=2,
        source="https://cloud.google.com/tpu/docs/v5p",
    ),
    "v6e": Chip(
        name="v6e",
        hbm_gib=32.0,
        hbm_bandwidth=1638e9,
        bf16_peak=918e12,
        chips_per_host=8,
        cores_per_chip=1,
        source="https://cloud.google.com/tpu/docs/v6e",
    ),
}

# What `hbm_gib` the memory planner uses per chip (plan/advice.py, experiments/plan.py).
CHIP_HBM_GIB = {name: chip.hbm_gib for name, chip in CHIPS.items()}


def chip(name: str) -> Chip:
    try:
        return CHIPS[name]
    except KeyError:
        raise ConfigError(f"unknown TPU chip {name!r}; known: {sorted(CHIPS)}") from None


def markdown_table() -> str:
    rows = [
        "| chip | HBM per chip | HBM bandwidth | bf16 peak | chips per host | source |",
        "|---|---|---|---|---|---|",
    ]
    for c in CHIPS.values():
        rows.append(
            f"| {c.name} | {c.hbm_gib:g} GiB | {c.hbm_bandwidth / 1e9:,.0f} GB/s | "
            f"{c.bf16_peak / 1e12:g} TFLOP/s | {c.chips_per_host} | {c.source} |"
        )
    return "\n".join(rows)

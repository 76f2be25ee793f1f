"""Throughput vs concurrency: every method over every domain's prompts at every concurrency.

Names: c concurrency (= engine slots), K block size, W verify width, n_i the verify steps of
request i.

A cell is (method, c, domain). Its requests — the domain's prompts, cycled until there are at
least c so every slot fills — flow through one `SpeculativeEngine` with c slots (continuous
batching). Plain decoding runs through the same engine (`drafter=None`), so prefill,
scheduling and host round trips cost the same and `ratio_to_plain` compares like with like.
Each cell is warmed up and timed on the harnesses' one timing path (`bench/decode_timing.py`:
nothing compiles while timed); `repeats` rounds time one pass of every method of the
(concurrency, domain) in turn and each cell keeps its fastest, so the methods share every
stretch of a machine whose speed drifts. The methods are `bench/methods.py`'s, a cell's row
and trace `bench/cell.py`'s (its occupancy replayed by `bench/occupancy.py`), the domain
"all" rows and the ideal speedup `bench/report.py`'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax

from adaflash_jax.bench.cell import cell_record
from adaflash_jax.bench.decode_timing import TimedPass, timed_pass, warm_up
from adaflash_jax.bench.methods import BenchError, Method
from adaflash_jax.bench.report import add_ideal_speedup, aggregate
from adaflash_jax.bench.step_cost import measure
from adaflash_jax.decode.build import build_engine
from adaflash_jax.decode.slots import (
    DEFAULT_BUCKETS,
    NO_ACCEPT_OUTPUT,
    SpeculativeEngine,
    has_accept_output,
    token_bucket_set,
)
from adaflash_jax.decode.state import bucket_set
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.distill.shapes import slot_capacity
from adaflash_jax.io.cost_table import VerifyCostTable

CPU_CONCURRENCY = (1, 4, 16, 64)
GPU_CONCURRENCY = (1, 32, 64, 128)


def default_concurrency(backend: str | None = None) -> tuple[int, ...]:
    return CPU_CONCURRENCY if (backend or jax.default_backend()) == "cpu" else GPU_CONCURRENCY


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSettings:
    concurrencies: tuple[int, ...]
    prompts_per_domain: int = 16
    max_new_tokens: int = 64
    max_prompt_len: int = 64
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    adaflash_threshold: int = 48  # the reference rule acts only above this many running rows
    goodput_estimator: str = "confidence"
    repeats: int = 1
    requests_per_slot: float = 1.0  # a cell has max(prompts, ceil(this · c)) requests
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "concurrencies", tuple(int(c) for c in self.concurrencies))
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise BenchError(f"concurrencies must be positive: {self.concurrencies}")
        for name in ("prompts_per_domain", "max_new_tokens", "max_prompt_len", "repeats"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.requests_per_slot <= 0:
            raise BenchError(f"requests_per_slot must be > 0: {self.requests_per_slot}")
        if self.adaflash_threshold < 0:
            raise BenchError(f"adaflash_threshold must be >= 0: {self.adaflash_threshold}")


def cell_requests(
    prompts: Sequence[Sequence[int]], concurrency: int, max_new: int, per_slot: float = 1.0
):
    """The domain's prompts, cycled to at least `per_slot · concurrency` requests. With one
    per slot they all start together and the batch drains as they finish; more keep the
    slots full for longer (and cost more prefill programs: one per padded group shape)."""
    if not prompts:
        raise BenchError("a domain has no prompts")
    n = max(len(prompts), math.ceil(per_slot * concurrency))
    return [(list(prompts[i % len(prompts)]), max_new) for i in range(n)]


@dataclasses.dataclass
class BenchResult:
    rows: list[dict]  # per (method, concurrency, domain), plus domain "all" aggregates
    traces: list[dict]  # per speculative cell: per-request accepted / requested widths
    cost_tables: dict[str, VerifyCostTable]  # per drafter name (goodput, ideal speedup)
    meta: dict


class ThroughputBench:
    """Holds the models and settings; `run()` measures every cell."""

    def __init__(
        self,
        target,
        drafters: dict,
        prompts: dict[str, list[list[int]]],
        methods: Sequence[Method],
        settings: BenchSettings,
        *,
        cost_tables: dict[str, VerifyCostTable] | None = None,
        log: Callable[[str], None] = print,
    ):
        self.target, self.drafters, self.settings, self.log = target, drafters, settings, log
        self.methods = list(methods)
        if not any(m.drafter is None for m in self.methods):
            self.methods.insert(0, Method())  # ratios need plain decoding in the same run
        self.methods.sort(key=lambda m: m.drafter is not None)  # plain first
        for m in self.methods:
            if m.drafter is not None and m.drafter not in drafters:
                raise BenchError(
                    f"method {m.label} needs drafter {m.drafter!r}; have {sorted(drafters)}"
                )
            head = m.drafter is not None and drafters[m.drafter].length_head is not None
            if m.policy == "adaflash" and not head:
                raise BenchError(f"method {m.label}: drafter {m.drafter!r} has no length head")
            estimator = dict(m.options).get("estimator", settings.goodput_estimator)
            wants_output = m.policy == "goodput" and estimator == "head"
            if wants_output and not has_accept_output(drafters[m.drafter]):
                raise BenchError(f"method {m.label}, drafter {m.drafter!r}: {NO_ACCEPT_OUTPUT}")
        cut = settings.max_prompt_len
        self.prompts = {d: [list(p[-cut:]) for p in ps] for d, ps in prompts.items()}
        if not self.prompts or any(not ps for ps in self.prompts.values()):
            raise BenchError(f"every domain needs prompts: {sorted(self.prompts)}")
        self.capacity = self._capacity()
        self.cost_tables = dict(cost_tables or {})
        # goodput uses a given table as it is; otherwise its engine's row of the measured one
        self.given_tables = dict(cost_tables or {})
        self.tree_tables: dict[tuple, VerifyCostTable] = {}  # (drafter, TreeShape): goodput's
        self._engines: dict[tuple, SpeculativeEngine] = {}

    def _capacity(self) -> int:
        k = max([1] + [d.config.block_size for d in self.drafters.values()])
        longest = max(len(p) for ps in self.prompts.values() for p in ps)
        need = slot_capacity(longest, self.settings.max_new_tokens, k)
        limit = self.target.config.max_position_embeddings
        if need > limit:
            raise BenchError(
                f"prompt {longest} + max_new {self.settings.max_new_tokens} + block {k} needs "
                f"a cache of {need}, beyond the target's max_position_embeddings {limit}"
            )
        return need

    # ---- engines --------------------------------------------------------------------------
    def cost_table(self, name: str) -> VerifyCostTable:
        """The drafter's cost table at the benchmark's concurrencies and capacity (measured on
        the engine's loop programs once per drafter architecture, unless given)."""
        if name not in self.cost_tables:
            drafter = self.drafters[name]
            same = [
                n
                for n in self.cost_tables
                if n in self.drafters
                and self.drafters[n].config == drafter.config
                and (self.cost_tables[n].fills or not self.packs(name))
            ]
            if same:
                self.cost_tables[name] = self.cost_tables[same[0]]
            else:
                widths = bucket_set(self.settings.buckets, drafter.config.block_size)
                rows = tuple(sorted(set(self.settings.concurrencies)))
                fills = token_bucket_set(1, widths) if self.packs(name) else ()
                t0 = time.perf_counter()
                self.cost_tables[name] = measure(
                    self.target,
                    drafter,
                    rows=rows,
                    capacity=self.capacity,
                    buckets=widths,
                    temperature=self.settings.temperature,
                    rounds=self.settings.repeats + 1,
                    fills=fills,
                )
                self.log(
                    f"measured the step costs of {name!r}: rows {rows} x widths {widths} "
                    f"in {time.perf_counter() - t0:.1f} s"
                )
        return self.cost_tables[name]

    def tree_table(self, name: str, tree: TreeShape) -> VerifyCostTable:
        """The drafter's cost table with the packed form timed on the draft-tree engine of
        shape `tree` (its fills up to the tree's row width), measured once per shape."""
        key = (name, tree)
        if key not in self.tree_tables:
            t0 = time.perf_counter()
            self.tree_tables[key] = measure(
                self.target,
                self.drafters[name],
                rows=tuple(sorted(set(self.settings.concurrencies))),
                capacity=self.capacity,
                buckets=bucket_set(self.settings.buckets, self.drafters[name].config.block_size),
                temperature=self.settings.temperature,
                rounds=self.settings.repeats + 1,
                fills=token_bucket_set(1, (tree.row_width,)),
                tree=tree,
            )
            self.log(f"measured the step costs of {name!r} with trees {tree} "
                     f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
        return self.tree_tables[key]

    def goodput_table(self, m: Method, concurrency: int) -> VerifyCostTable:
        """A given table as it is; else the measured table's row of this concurrency (with
        trees, the tree engine's)."""
        if m.drafter in self.given_tables:
            return self.given_tables[m.drafter]
        tree = m.engine_options.get("tree")
        if tree is not None:
            return self.tree_table(m.drafter, tree).at_rows(concurrency)
        return self.cost_table(m.drafter).at_rows(concurrency)

    def policy_kwargs(self, m: Method) -> dict:
        kw = {}
        if m.policy == "adaflash":
            kw["threshold"] = self.settings.adaflash_threshold
        if m.policy == "goodput":
            kw["estimator"] = self.settings.goodput_estimator
        return {**kw, **m.policy_options}

    def packs(self, name: str) -> bool:
        """Some method of drafter `name` verifies packed (its table needs the packed form)."""
        return any(
            m.engine_options.get("verify") == "packed" for m in self.methods if m.drafter == name
        )

    def engine(self, m: Method, concurrency: int) -> SpeculativeEngine:
        key = (m, concurrency)
        if key not in self._engines:
            drafter = None if m.drafter is None else self.drafters[m.drafter]
            self._engines[key] = build_engine(
                self.target,
                drafter,
                slots=concurrency,
                capacity=self.capacity,
                buckets=self.settings.buckets,
                policy=m.policy or "fixed",
                cost_table=self.goodput_table(m, concurrency) if m.policy == "goodput" else None,
                policy_kwargs=self.policy_kwargs(m) if drafter is not None else None,
                temperature=self.settings.temperature,
                seed=self.settings.seed,
                **m.engine_options,
            )
        return self._engines[key]

    # ---- one (concurrency, domain) --------------------------------------------------------
    def requests(self, concurrency: int, domain: str) -> list:
        return cell_requests(
            self.prompts[domain],
            concurrency,
            self.settings.max_new_tokens,
            self.settings.requests_per_slot,
        )

    def measure_level(self, concurrency: int, domain: str) -> list[tuple[dict, dict | None]]:
        """Every method at one (concurrency, domain): each warms up once, then `repeats`
        rounds time one pass of every method in turn and each keeps its fastest. Interleaving
        rounds puts every method through the same stretch of a machine whose speed drifts,
        so the ratios to plain compare like with like."""
        requests = self.requests(concurrency, domain)
        warmup, start = {}, {}
        for m in self.methods:
            warmup[m], start[m] = warm_up(self.engine(m, concurrency), requests)
        best: dict[Method, TimedPass] = {}
        compiles = dict.fromkeys(self.methods, 0)
        for _ in range(self.settings.repeats):
            for m in self.methods:
                timed = timed_pass(self.engine(m, concurrency), requests, start[m])
                compiles[m] += timed.compiles
                if m not in best or timed.wall_s < best[m].wall_s:
                    best[m] = timed
        return [
            cell_record(
                m,
                self.engine(m, concurrency),
                concurrency,
                domain,
                best[m],
                policy_options=self.policy_kwargs(m) if m.drafter is not None else {},
                warmup=warmup[m],
                compiles=compiles[m],
            )  # fmt: skip
            for m in self.methods
        ]

    # ---- everything -----------------------------------------------------------------------
    def run(self, on_level: Callable[[BenchResult], None] | None = None) -> BenchResult:
        """Every cell, concurrency levels in the given order; `on_level` gets the result so
        far after each level (a run cut short keeps its finished levels)."""
        rows, traces = [], []
        t_start = time.perf_counter()
        result = None
        for name in dict.fromkeys(m.drafter for m in self.methods if m.drafter is not None):
            self.cost_table(name)  # step costs: goodput, the ideal speedup, the projection
        for c in self.settings.concurrencies:
            for domain in self.prompts:
                plain = None
                for m, (row, trace) in zip(self.methods, self.measure_level(c, domain)):
                    plain = row if m.drafter is None else plain
                    row["ratio_to_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
                    # greedy speculative decoding is lossless: the same tokens as plain
                    row["matches_plain"] = row["output_digest"] == plain["output_digest"]
                    rows.append(row)
                    if trace is not None:
                        traces.append(trace)
                    self.log(
                        f"c={c:<4d} {domain:<9s} {m.label:<28s} {row['tokens_per_s']:9.1f} tok/s"
                        f"  x{row['ratio_to_plain']:.2f}  tau {row['tau']:.2f}  width "
                        f"{row['mean_verify_width']:.2f}  running {row['mean_running']:.1f}"
                    )
            result = self._result(rows, traces, time.perf_counter() - t_start)
            if on_level is not None:
                on_level(result)
        return result

    def _result(self, rows, traces, wall_s: float) -> BenchResult:
        rows = rows + aggregate(rows)
        for name, drafter in self.drafters.items():  # same architecture → same costs
            for other, table in list(self.cost_tables.items()):
                same = other in self.drafters and self.drafters[other].config == drafter.config
                if name not in self.cost_tables and same:
                    self.cost_tables[name] = table
        add_ideal_speedup(rows, self.cost_tables)
        meta = {
            "settings": dataclasses.asdict(self.settings),
            "methods": [m.label for m in self.methods],
            "domains": list(self.prompts),
            "prompts_per_domain": {d: len(ps) for d, ps in self.prompts.items()},
            "capacity": self.capacity,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "target": dataclasses.asdict(self.target.config),
            "drafters": {
                n: {"block_size": d.config.block_size, "layers": d.config.num_hidden_layers}
                for n, d in self.drafters.items()
            },
            "wall_s": wall_s,
            # the verify-cost table each goodput engine decided with (its own step, measured
            # or loaded from the per-device cache, unless one was given)
            "goodput_tables": {
                f"{m.label} c={c}": engine.policy.cost.to_json()
                for (m, c), engine in self._engines.items()
                if m.policy == "goodput"
            },
        }
        return BenchResult(
            rows=rows, traces=list(traces), cost_tables=dict(self.cost_tables), meta=meta
        )

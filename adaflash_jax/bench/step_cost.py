"""The one cost-table producer: times the engine's own jitted loop program at each verify width.

Dimensions: B engine rows (slots), K block size, W verify width (a bucket), NR row counts.

For each row count B it builds the engine and times `programs.run_loop`, the program serving
runs, with the spec pinned to one bucket W (every row verifies W tokens a step, as
`aot/decode_programs.py` compiles it for the TPU estimates), the plain engine's loop (no
drafter), and the drafter's block forward. `table_from_steps` turns those into the table
(`io/cost_table.py`), for the timings here and for the TPU compiler estimates alike:

    verify_ms[W=1] = step(plain)          draft_ms = draft forward
    verify_ms[W]   = step(drafted at W) − draft_ms      (so draft + verify[W] is that step)
    packed_ms[f]   = step(packed at B·f tokens) − draft_ms, packed_ms[1] = verify_ms[1]
    switch_ms      = call(plain, 1 step) − step(plain)  (a device call's own overhead)

where step(p) = (call(p, n steps) − call(p, 1 step)) / (n − 1): a call's own overhead
(dispatch, the loop's entry, the host fetch) cancels instead of being charged to every step.
Every case is timed once per round, rounds interleaved (a machine whose speed drifts slows all
cases alike), after one compiling round; a case's cost is its fastest round (interference
only ever adds time). `engine_table` measures the table of one goodput engine for
`decode.build.build_engine`, cached per device, models and settings under
`~/.cache/adaflash_jax/verify_cost/` (override: `cache_dir=` or $ADAFLASH_CACHE).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decode import programs
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import FixedPolicy
from adaflash_jax.decode.slots import DEFAULT_BUCKETS, SpeculativeEngine
from adaflash_jax.io.cost_table import VerifyCostTable

KIND = "engine-loop/1"  # bump when the step program changes: cached tables go stale


def pinned_spec(engine: SpeculativeEngine, width: int):
    """The engine's loop spec verifying exactly `width` tokens a row every step."""
    return dataclasses.replace(engine.spec, buckets=(width,), policy=FixedPolicy())


def pinned_packed_spec(engine: SpeculativeEngine, fill: int):
    """The engine's loop spec under packed verify, every row at `fill` tokens: the step at
    token bucket slots·fill (a tree engine's rows verify their root and first fill − 1
    nodes)."""
    tokens = (engine.slots * fill,)
    if engine.spec.tree is None:
        return dataclasses.replace(pinned_spec(engine, fill), token_buckets=tokens)
    return dataclasses.replace(engine.spec, policy=FixedPolicy(width=fill), token_buckets=tokens)


def _verify_only(plain_ms, draft_ms, drafted_ms):
    return [
        (plain, *(max(d - draft, 1e-6) for d in drafted))
        for plain, draft, drafted in zip(plain_ms, draft_ms, drafted_ms)
    ]


def table_from_steps(
    *,
    rows,
    widths,
    plain_ms,
    draft_ms,
    drafted_ms,
    switch_ms=0.0,
    fills=(),
    packed_ms=(),
    device: str,
    model: str,
) -> VerifyCostTable:
    """The table from per-row step costs: `plain_ms[i]`, `draft_ms[i]` and `drafted_ms[i][j]`
    (the drafted step at `widths[j]`, every width > 1) for row count `rows[i]`; with
    `packed_ms[i][j]`, the packed drafted step at token bucket rows[i]·fills[j] (every fill
    > 1: fill 1 is the plain step too)."""
    widths, fills = tuple(int(w) for w in widths), tuple(int(f) for f in fills)
    if 1 in widths or 1 in fills:
        raise ValueError("the drafted widths and fills exclude 1: that is the plain step")
    packed = _verify_only(plain_ms, draft_ms, packed_ms) if fills else ()
    return VerifyCostTable(
        rows=tuple(rows),
        widths=(1, *widths),
        verify_ms=tuple(_verify_only(plain_ms, draft_ms, drafted_ms)),
        draft_ms=tuple(draft_ms),
        switch_ms=switch_ms,
        fills=(1, *fills) if fills else (),
        packed_ms=tuple(packed),
        device=device,
        model=model,
    )


@jax.jit
def draft_forward(target, drafter, cache, bonus_B):
    """`Drafter.draft` after each row's bonus token (the target lends its embedding/head)."""
    target, drafter = nnx.merge(*target), nnx.merge(*drafter)
    out = drafter.draft(cache, bonus_B, target.embedding_VxD(), target.lm_head_DxV())
    return out.logits_BxKm1xV


def _loop_ms(engine: SpeculativeEngine, spec, *, steps: int, prompt_len: int, seed: int):
    """ms of one `run_loop` call running `steps` iterations over all slots, from a fresh
    prefill of random prompts (untimed) that keeps every row active and inside the cache."""
    b, cap = engine.slots, engine.capacity
    state = engine.init_state(seed)  # built with eos_ids=(): no row finishes early
    prompts = np.random.default_rng(seed).integers(
        0, engine.target.config.vocab_size, (b, prompt_len)
    )
    state = programs.prefill_slots(
        *engine.models,
        state,
        jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(prompts, jnp.int32),
        jnp.full((b,), prompt_len, jnp.int32),
        jnp.full((b,), cap - prompt_len - engine.block_size, jnp.int32),
        spec=spec.prefill_spec,
    )
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state, ran, _, _ = programs.run_loop(
        *engine.models, state, jnp.asarray(False), jnp.asarray(steps, jnp.int32), spec=spec
    )
    ran = int(jax.device_get(ran))
    elapsed = time.perf_counter() - t0
    if ran != steps:
        raise RuntimeError(f"cost measurement loop ran {ran} of {steps} steps")
    return 1e3 * elapsed


def _draft_ms(engine: SpeculativeEngine, *, context: int, seed: int) -> float:
    cache = engine.drafter.init_context_cache(engine.slots, engine.capacity)
    cache = cache.with_lengths(jnp.full((engine.slots,), context, jnp.int32))
    bonus_B = jnp.asarray(np.random.default_rng(seed).integers(0, 2, engine.slots), jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(draft_forward(*engine.models, cache, bonus_B))
    return 1e3 * (time.perf_counter() - t0)


def measure(
    target,
    drafter,
    *,
    rows,
    capacity: int,
    buckets=DEFAULT_BUCKETS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    steps: int = 16,
    rounds: int = 6,
    seed: int = 0,
    fills=(),
    tree=None,
) -> VerifyCostTable:
    """The table of the engine (target, drafter, `capacity`, `buckets`, sampling mode) at each
    row count in `rows`, with the packed form at `fills` (mean tokens per row, () none),
    timed on the draft-tree engine of shape `tree` when given (its step builds the tree).
    Compiles, per row count, one loop program per bucket > 1 and per fill > 1, the plain
    loop and the drafter forward."""
    kw = dict(capacity=capacity, temperature=temperature, top_p=top_p, eos_ids=())
    fills = sorted({int(f) for f in fills} - {1})
    plain_ms, draft_ms, drafted_ms, packed_ms, switch = [], [], [], [], []
    for b in sorted(set(int(r) for r in rows)):
        spec_engine = SpeculativeEngine(target, drafter, slots=b, buckets=buckets, **kw)
        plain_engine = SpeculativeEngine(target, None, slots=b, **kw)
        packed_engine = spec_engine
        if tree is not None:
            packed_engine = SpeculativeEngine(
                target, drafter, slots=b, buckets=buckets, tree=tree, **kw
            )
        k = spec_engine.block_size
        n = max(2, min(steps, (capacity - 2) // (2 * k)))
        prompt_len = max(1, min(capacity // 4, capacity - k * (n + 1)))
        widths = [w for w in spec_engine.buckets if w > 1]
        cases = [(plain_engine, plain_engine.spec)]
        cases += [(spec_engine, pinned_spec(spec_engine, w)) for w in widths]
        cases += [(packed_engine, pinned_packed_spec(packed_engine, f)) for f in fills]
        calls = [[] for _ in range(2 * len(cases) + 1)]  # (n steps, 1 step) per case, draft
        for r in range(rounds + 1):
            for i, (engine, spec) in enumerate(cases):
                for j, count in enumerate((n, 1)):
                    ms = _loop_ms(engine, spec, steps=count, prompt_len=prompt_len, seed=seed + r)
                    calls[2 * i + j].append(ms)
            calls[-1].append(_draft_ms(spec_engine, context=prompt_len, seed=seed + r))
        fastest = [min(t[1:]) for t in calls]  # round 0 compiles
        per_step = [max((fastest[2 * i] - fastest[2 * i + 1]) / (n - 1), 1e-3)
                    for i in range(len(cases))]  # fmt: skip
        plain_ms.append(per_step[0])
        drafted_ms.append(per_step[1 : 1 + len(widths)])
        packed_ms.append(per_step[1 + len(widths) :])
        # a lone forward call carries its dispatch: never more than a drafted step holding it
        draft_ms.append(min([fastest[-1], *per_step[1:2]]))
        switch.append(max(fastest[1] - per_step[0], 0.0))
    return table_from_steps(
        rows=sorted(set(int(r) for r in rows)),
        widths=widths,
        plain_ms=plain_ms,
        draft_ms=draft_ms,
        drafted_ms=drafted_ms,
        switch_ms=float(np.median(switch)),
        fills=fills,
        packed_ms=packed_ms if fills else (),
        device=device_kind(),
        model=f"{KIND} capacity {capacity} {'greedy' if temperature == 0 else 'sampled'} "
        + hashlib.sha1(model_key(target, drafter).encode()).hexdigest()[:12],
    )


# ---- the per-device cache ----------------------------------------------------------------------
def device_kind() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{dev.device_kind}"


def model_key(target, drafter) -> str:
    t = dataclasses.asdict(target.config)
    d = dataclasses.asdict(drafter.config) if drafter is not None else None
    dtypes = (str(target.dtype), str(None if drafter is None else drafter.dtype))
    return json.dumps([t, d, dtypes], sort_keys=True, default=str)


def cache_path(target, drafter, *, rows, cache_dir: str | None = None, **settings) -> str:
    """`<cache_dir>/<device>-r<rows>-<hash of device, models and settings>.json`."""
    key = json.dumps([KIND, device_kind(), model_key(target, drafter), list(rows), settings],
                     sort_keys=True, default=str)  # fmt: skip
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    kind = device_kind().replace(" ", "_").replace("/", "_").replace(":", "_")
    base = os.environ.get("ADAFLASH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "adaflash_jax"
    )
    name = f"{kind}-r{'_'.join(map(str, rows))}-{digest}.json"
    return os.path.join(cache_dir or os.path.join(base, "verify_cost"), name)


def engine_table(
    target, drafter, *, policy_kwargs: dict | None = None, cache_dir: str | None = None, **engine_kw
) -> VerifyCostTable:
    """The table of the goodput engine `build_engine(target, drafter, policy="goodput",
    policy_kwargs=..., **engine_kw)` builds: the cached one for this device, models and
    settings, else a fresh measurement (then cached). The engine's settings and goodput's
    options are checked first, on a flat table, before any compute."""
    k = max(engine_kw.get("block_size") or drafter.config.block_size, 1)
    tree = engine_kw.get("tree")
    f = k if tree is None else max(k, tree.row_width)
    flat = VerifyCostTable(
        rows=(1,), widths=range(1, k + 1), verify_ms=((1.0,) * k,), draft_ms=(0,),
        fills=range(1, f + 1), packed_ms=((1.0,) * f,),
    )  # fmt: skip
    policy = GoodputPolicy(cost=flat, **(policy_kwargs or {}))
    e = SpeculativeEngine(target, drafter, **engine_kw, policy=policy)
    settings = dict(
        capacity=e.capacity, buckets=e.buckets, temperature=e.temperature, top_p=e.top_p
    )
    if e.spec.packed:  # the packed form at the engine's token buckets
        settings["fills"] = tuple(p // e.slots for p in e.token_buckets)
    if e.spec.tree is not None:
        settings["tree"] = e.spec.tree
    path = cache_path(e.target, e.drafter, rows=(e.slots,), cache_dir=cache_dir, **settings)
    if os.path.isfile(path):
        return VerifyCostTable.load(path)
    table = measure(e.target, e.drafter, rows=(e.slots,), **settings)
    table.save(path)
    return table

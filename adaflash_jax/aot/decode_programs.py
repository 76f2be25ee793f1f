"""Decoding programs as deviceless programs: regeneration, the speculative engine's step at
each verify width, the plain (undrafted) engine step, and the drafter's block forward.

Dimensions: B rows (slots), P padded prompt length, N new tokens, C cache capacity, W verify
width, K block size.

Each is the project's own jitted entry point: `decode.programs.run_loop` (the engine's device
loop, built by `decode.slots.SpeculativeEngine` from abstract models; without a drafter it is
the plain decoder regeneration runs), `decode.programs.prefill_slots` (its prefill) and
`Drafter.draft`. The engine loop
runs one step per iteration; XLA's cost analysis counts a while loop's body once, so its
figures are one step's (plus the loop's small prologue). For a per-width figure the loop is
compiled with a single bucket W (`EngineSpec` then caps every verify at W): the serving engine
picks among all buckets with a `lax.switch`, whose cost analysis cannot say which branch runs.
The decoders' rows (slots, regeneration's batch) are split over the rules' batch axes
(`sharding.rows.RowLayout`), as the distill run lays them out: their state is lowered with
that sharding and the programs constrain their fresh caches to it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from adaflash_jax.aot.abstract import (
    abstract_drafter_params,
    abstract_target,
    per_chip_bytes,
    struct,
)
from adaflash_jax.aot.program import Program
from adaflash_jax.decode.programs import prefill_slots, run_loop
from adaflash_jax.decode.slots import DEFAULT_BUCKETS, SpeculativeEngine
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.sharding.rows import RowLayout
from adaflash_jax.sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Models:
    """Sharded abstract target and drafter, and the modules an engine is built around."""

    target_cfg: TargetConfig
    drafter_cfg: DrafterConfig
    target: tuple  # (graphdef, sharded abstract params)
    drafter: tuple
    target_module: nnx.Module  # abstract modules (ShapeDtypeStruct values)
    drafter_module: nnx.Module
    mesh: Mesh
    rules: Rules

    def rows(self, n: int) -> RowLayout | None:
        """How `n` decoding rows are split over the mesh (None: every chip holds all)."""
        return RowLayout.of(self.mesh, self.rules, n)

    @property
    def target_bytes(self) -> int:
        return per_chip_bytes(self.target[1])

    @property
    def drafter_bytes(self) -> int:
        return per_chip_bytes(self.drafter[1])


def models(target_cfg, drafter_cfg, mesh: Mesh, rules: Rules, *, dtype, drafter_param_dtype):
    target = abstract_target(target_cfg, dtype, mesh, rules)
    drafter = abstract_drafter_params(drafter_cfg, dtype, mesh, rules, drafter_param_dtype)
    return Models(
        target_cfg=target_cfg,
        drafter_cfg=drafter_cfg,
        target=target,
        drafter=drafter,
        target_module=nnx.merge(*target),
        drafter_module=nnx.merge(*drafter),
        mesh=mesh,
        rules=rules,
    )


def generate_programs(m: Models, *, batch: int, prompt_len: int, max_new: int) -> list[Program]:
    """Regeneration's plain decoder (`decode.generate`: the engine without a drafter) at its
    batch: the prefill of every slot and the plain step."""
    capacity = prompt_len + max_new
    prefill = prefill_program(
        m, slots=batch, capacity=capacity, prompt_len=prompt_len, drafted=False
    )
    step = plain_program(m, slots=batch, capacity=capacity)
    note = "regeneration: the plain decoder"
    return [
        dataclasses.replace(
            prefill, name=f"generate prefill B={batch}", notes=(*prefill.notes, note)
        ),
        dataclasses.replace(step, name=f"generate B={batch}", notes=(*step.notes, note)),
    ]


def _engine(m: Models, slots: int, capacity: int, temperature: float, drafted: bool, tree=None):
    return SpeculativeEngine(
        m.target_module,
        m.drafter_module if drafted else None,
        slots=slots,
        capacity=capacity,
        buckets=DEFAULT_BUCKETS,
        temperature=temperature,
        eos_ids=(0,),
        rows=m.rows(slots),
        tree=tree,
    )


def _in_layout(tree, layout, rows: int):
    """Abstract arrays carrying `layout`'s shardings for `rows` rows (unchanged without one)."""
    if layout is None:
        return tree
    shardings = layout.shardings(tree, rows)
    return jax.tree.map(lambda x, sh: struct(x.shape, x.dtype, sh), tree, shardings)


def _engine_state(engine):
    """The engine's abstract state, lowered in its row layout."""
    state = jax.eval_shape(lambda: engine.init_state(0))
    return _in_layout(state, engine.spec.rows, engine.slots)


def _loop_program(m: Models, engine, spec, name: str, width: int) -> Program:
    drafted = engine.drafter is not None
    state = _engine_state(engine)
    args = (
        m.target,
        m.drafter if drafted else None,
        state,
        struct((), jnp.bool_),
        struct((), jnp.int32),
    )
    return Program(
        name=name,
        kind="decode",
        fn=run_loop,
        args=args,
        static=dict(spec=spec),
        weight_bytes=m.target_bytes + (m.drafter_bytes if drafted else 0),
        rows=engine.slots,
        width=width,
        notes=(f"{engine.slots} slots, cache {engine.capacity}",),
    )


def engine_programs(
    m: Models, *, slots: int, capacity: int, temperature: float = 0.0, widths=None
) -> list[Program]:
    """The engine's drafted step pinned to each verify bucket (default: all of them)."""
    engine = _engine(m, slots, capacity, temperature, drafted=True)
    out = []
    for w in widths or engine.buckets:
        spec = dataclasses.replace(engine.spec, buckets=(w,))
        p = _loop_program(m, engine, spec, f"engine W={w} B={slots}", w)
        if w == 1:  # nothing reads the drafts, so XLA drops the drafter forward
            p = dataclasses.replace(p, notes=(*p.notes, "W=1 pinned: no draft verified"))
        out.append(p)
    return out


def packed_engine_programs(m: Models, *, slots: int, capacity: int, fills) -> list[Program]:
    """The engine's drafted step under packed verify (docs/design.md §5.5), pinned to token
    bucket slots·f for each fill f > 1: every row verifies f tokens."""
    engine = _engine(m, slots, capacity, 0.0, drafted=True)
    out = []
    for f in fills:
        spec = dataclasses.replace(engine.spec, buckets=(f,), token_buckets=(slots * f,))
        p = _loop_program(m, engine, spec, f"packed F={f} B={slots}", f)
        out.append(dataclasses.replace(p, notes=(*p.notes, f"packed verify of {slots * f}")))
    return out


def tree_engine_programs(m: Models, *, slots: int, capacity: int, trees) -> list[Program]:
    """The engine's drafted step with draft trees (docs/design.md §5.6), each `TreeShape`
    pinned to token bucket slots·(Y + 1): every row verifies its whole tree."""
    out = []
    for tree in trees:
        engine = _engine(m, slots, capacity, 0.0, drafted=True, tree=tree)
        w = tree.row_width
        spec = dataclasses.replace(engine.spec, token_buckets=(slots * w,))
        p = _loop_program(m, engine, spec, f"tree {tree} B={slots}", w)
        out.append(dataclasses.replace(p, notes=(*p.notes, f"tree verify of {slots * w}")))
    return out


def prefill_program(
    m: Models, *, slots: int, capacity: int, prompt_len: int, drafted: bool = True
) -> Program:
    """The engine's prefill of every slot at once (its first call: all slots free), prompts
    padded as `SpeculativeEngine` pads them (a power of two, at least 16, within capacity);
    without the drafter (`drafted=False`), the plain decoder's."""
    engine = _engine(m, slots, capacity, 0.0, drafted=drafted)
    p = min(max(16, 1 << (prompt_len - 1).bit_length()), capacity)
    rows = lambda: struct((slots,), jnp.int32)  # noqa: E731
    inputs = (rows(), struct((slots, p), jnp.int32), rows(), rows())
    inputs = _in_layout(inputs, engine.spec.rows, slots)
    args = (m.target, m.drafter if drafted else None, _engine_state(engine), *inputs)
    return Program(
        name=f"prefill B={slots}",
        kind="decode",
        fn=prefill_slots,
        args=args,
        static=dict(spec=engine.spec.prefill_spec),
        weight_bytes=m.target_bytes + (m.drafter_bytes if drafted else 0),
        rows=slots,
        notes=(f"{slots} prompts of {p} tokens into a cache of {capacity}",),
    )


def plain_program(m: Models, *, slots: int, capacity: int) -> Program:
    """The engine's plain decoding step (no drafter): one token per row."""
    engine = _engine(m, slots, capacity, 0.0, drafted=False)
    return _loop_program(m, engine, engine.spec, f"plain B={slots}", 1)


def _draft(tdef, tstate, ddef, dstate, cache, bonus_B):
    target, drafter = nnx.merge(tdef, tstate), nnx.merge(ddef, dstate)
    return drafter.draft(cache, bonus_B, target.embedding_VxD(), target.lm_head_DxV())


_draft_jit = jax.jit(_draft, static_argnames=("tdef", "ddef"))


def draft_program(m: Models, *, slots: int, capacity: int) -> Program:
    """`Drafter.draft`: one block forward after each row's bonus token."""
    cache = jax.eval_shape(lambda: m.drafter_module.init_context_cache(slots, capacity))
    cache, bonus = _in_layout((cache, struct((slots,), jnp.int32)), m.rows(slots), slots)
    args = (*m.target, *m.drafter, cache, bonus)
    return Program(
        name=f"draft B={slots}",
        kind="decode",
        fn=_draft_jit,
        args=args,
        weight_bytes=m.drafter_bytes + per_chip_bytes(_head_tables(m)),
        rows=slots,
        notes=(f"{slots} rows, context cache {capacity}",),
    )


def _head_tables(m: Models):
    """The target tables the drafter borrows (embedding, LM head): read by every draft."""
    params = m.target[1]
    tables = [params["embed_tokens"]]
    if "lm_head" in params:
        tables.append(params["lm_head"])
    return tables

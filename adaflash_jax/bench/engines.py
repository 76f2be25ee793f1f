"""Engines as the harnesses and CLIs build them: `decode.build.build_engine`, with goodput's
verify-cost table measured on that very engine (cached per device) when none is given, and
speculative generation of a prompt list at the slot capacity the prompts need; and the
speculative options a generating CLI parses into them."""

from __future__ import annotations

from collections.abc import Sequence

from adaflash_jax.bench.step_cost import engine_table
from adaflash_jax.cli import tree_shape
from adaflash_jax.decode.build import POLICY_NAMES, build_engine
from adaflash_jax.decode.goodput.policy import ESTIMATORS
from adaflash_jax.decode.slots import VERIFY_LAYOUTS, SpeculativeEngine
from adaflash_jax.distill.shapes import slot_capacity
from adaflash_jax.model.target import VERIFY_ATTENTION


def measured_engine(
    target, drafter, *, policy="fixed", policy_kwargs: dict | None = None, cost_table=None, **kw
) -> SpeculativeEngine:
    """`build_engine` with its options; goodput without a cost table gets its engine's own
    (`step_cost.engine_table`: measured once, then read from the cache)."""
    if policy == "goodput" and cost_table is None:
        cost_table = engine_table(target, drafter, policy_kwargs=policy_kwargs, **kw)
    return build_engine(
        target, drafter, policy=policy, policy_kwargs=policy_kwargs, cost_table=cost_table, **kw
    )


def speculative_generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    slots: int | None = None,
    block_size: int | None = None,
    **kw,
) -> list:
    """Every prompt through one engine (continuous batching over `slots`, default one per
    prompt) whose cache holds the longest prompt, the new tokens and a block (at most the
    target's positions); `kw` as `measured_engine`'s and the engine's (policy, temperature,
    seed, eos_ids, ...). Greedy output equals plain generation."""
    k = block_size or drafter.config.block_size
    need = slot_capacity(max(len(p) for p in prompts), max_new_tokens, k)
    engine = measured_engine(
        target,
        drafter,
        slots=slots or len(prompts),
        capacity=min(need, target.config.max_position_embeddings),
        block_size=block_size,
        **kw,
    )
    return engine.generate([(list(p), max_new_tokens) for p in prompts])


# ---- the speculative options of a generating CLI (experiments.generate) ---------------------
def add_engine_arguments(s) -> None:
    """The drafter, policy, layout, tree and kernel options on an argparse group."""
    s.add_argument("--drafter", help="DFlash/AdaFlash drafter dir: decode speculatively")
    s.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    s.add_argument("--policy", choices=POLICY_NAMES, default="fixed", help="verify width")
    s.add_argument("--slots", type=int, default=None, help="default: one per prompt")
    s.add_argument("--verify", choices=VERIFY_LAYOUTS, help="packed: each row's own tokens")
    s.add_argument(
        "--tree",
        type=tree_shape,
        help="TOPKxNODES[@head]: verify draft trees (packed), ranked by path probability or "
        "(@head) the length head's acceptance",
    )
    s.add_argument("--mean-nodes", type=float, help="--policy tree-batch: nodes per row")
    s.add_argument(
        "--verify-attention",
        choices=VERIFY_ATTENTION,
        default="xla",
        help="the verify pass's attention: xla, or the Pallas TPU kernel (pallas; interpret: "
        "the kernel interpreted, any backend)",
    )
    s.add_argument("--cost-table", help="cost-table JSON for goodput (default: measured)")
    s.add_argument("--estimator", choices=ESTIMATORS, help="goodput's acceptance estimate")
    s.add_argument("--no-skip-draft", action="store_true", help="goodput: no plain steps")


def check_engine_arguments(parser, a) -> None:
    """Options that need a drafter or another option: argparse's one-line usage error."""
    spec_only = a.block_size or a.slots or a.policy != "fixed" or a.cost_table or a.tree
    if a.drafter is None and (spec_only or a.verify or a.verify_attention != "xla"):
        parser.error(
            "--block-size/--slots/--policy/--cost-table/--verify/--tree/--verify-attention "
            "need --drafter"
        )
    if a.policy != "goodput" and (a.estimator or a.no_skip_draft):
        parser.error("--estimator/--no-skip-draft are options of --policy goodput")
    if (a.policy == "tree-batch") != (a.mean_nodes is not None):
        parser.error("--mean-nodes goes with --policy tree-batch, and it needs it")


def policy_options(args) -> dict | None:
    """The policy's keyword options from the parsed arguments."""
    if args.policy == "tree-batch":
        return {"mean_nodes": args.mean_nodes}
    if args.policy != "goodput":
        return None
    options = {"skip_draft": not args.no_skip_draft}
    return options | ({"estimator": args.estimator} if args.estimator else {})

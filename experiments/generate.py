"""Generate with a target, plainly or speculatively with a DFlash/AdaFlash drafter.

python -m experiments.generate --target DIR --prompt "Hi" --json
python -m experiments.generate --drafter DIR [--block-size K] [--policy goodput] [--slots N]
    [--verify packed]

With --drafter the prompts flow through `SpeculativeEngine` (continuous batching over
--slots slots, default: one per prompt); --json objects then add `accepted` (accepted drafts
per verify step), `tau` (mean accepted + 1) and `steps`. Greedy output equals plain output.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from adaflash_jax.bench.engines import (
    add_engine_arguments,
    check_engine_arguments,
    policy_options,
    speculative_generate,
)
from adaflash_jax.cli import int_list, one_line_errors
from adaflash_jax.decode.generate import GenerateError, generate
from adaflash_jax.drafter.checkpoint import load_drafter, thinking_mode
from adaflash_jax.embedded import default_target_dir as embedded_target_dir
from adaflash_jax.model.checkpoint import load_target
from adaflash_jax.model.config import ConfigError
from adaflash_jax.tokenizer import Tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", help="HF model dir (default: the embedded default target)")
    p.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    p.add_argument(
        "--prompt-ids", action="append", default=[], type=int_list, help="e.g. 1,2,3 (repeatable)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        help="--chat: enable_thinking for the template (default: what the --drafter export's "
        "adaflash_prompt_format records, else false, as distillation does)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_engine_arguments(p.add_argument_group("speculative decoding (with --drafter)"))
    a = p.parse_args(argv)
    check_engine_arguments(p, a)
    return a


def build_requests(args, tok: Tokenizer | None) -> list[list[int]]:
    """Token-id prompts from --prompt (tokenized, optionally chat-templated, thinking as
    `thinking_mode` decides) and --prompt-ids."""
    if args.prompt and tok is None:
        raise GenerateError("--prompt needs a tokenizer.json in the target dir; use --prompt-ids")
    thinking = thinking_mode(args.thinking, args.drafter)
    prompts = [
        tok.encode_chat([{"role": "user", "content": t}], enable_thinking=thinking)
        if args.chat
        else tok.encode(t)
        for t in args.prompt
    ]
    prompts += [list(ids) for ids in args.prompt_ids]
    if not prompts:
        raise GenerateError("give at least one --prompt or --prompt-ids")
    return prompts


def print_results(args, tok: Tokenizer | None, prompts, outputs, stats=None) -> None:
    """`stats`: per prompt {accepted, tau, steps} from speculative decoding, or None."""
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        text = tok.decode(out) if tok is not None else None
        extra = stats[i] if stats is not None else {}
        if args.json:
            print(json.dumps({"prompt_ids": prompt, "output_ids": out, "text": text, **extra}))
        else:
            spec = f" (tau {extra['tau']:.2f}, {extra['steps']} steps)" if extra else ""
            print(f"[{len(prompt)} prompt tokens]{spec} -> {text if text is not None else out}")


def main(argv=None) -> None:
    args = parse_args(argv)
    with one_line_errors():
        run(args)


def run(args) -> None:
    target_dir = args.target or os.fspath(embedded_target_dir())
    has_tok = os.path.isfile(os.path.join(target_dir, "tokenizer.json"))
    tok = Tokenizer(target_dir) if has_tok else None
    if args.verify_attention == "pallas" and jax.default_backend() != "tpu":
        raise GenerateError(
            f"--verify-attention pallas compiles a TPU kernel; this backend is "
            f"{jax.default_backend()} (use xla, or interpret to check the kernel here)"
        )
    model = load_target(
        target_dir, dtype=getattr(jnp, args.dtype), verify_attention=args.verify_attention
    )
    prompts = build_requests(args, tok)
    eos = tok.eos_token_ids if tok is not None and tok.eos_token_ids else None
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_ids=eos)
    if args.drafter is None:
        outputs = generate(model, prompts, max_new_tokens=args.max_new_tokens, **sampling)
        return print_results(args, tok, prompts, outputs)
    drafter = load_drafter(args.drafter, dtype=model.dtype)
    try:
        drafter.config.validate_against(model.config)
    except ConfigError as e:
        raise ConfigError(f"drafter {args.drafter} does not fit target: {e}") from None
    results = speculative_generate(
        model, drafter, prompts, max_new_tokens=args.max_new_tokens, slots=args.slots,
        block_size=args.block_size, policy=args.policy, policy_kwargs=policy_options(args),
        cost_table=args.cost_table, verify=args.verify, tree=args.tree, **sampling,
    )  # fmt: skip
    stats = [
        {"accepted": r.accepted, "tau": None if r.steps == 0 else r.tau, "steps": r.steps}
        for r in results
    ]
    print_results(args, tok, prompts, [r.output_ids for r in results], stats)


if __name__ == "__main__":
    main()

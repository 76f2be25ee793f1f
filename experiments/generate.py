"""Generate with a target: `python -m experiments.generate --target DIR --prompt "Hi" --json`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import jax.numpy as jnp

from adaflash_jax.decode.generate import GenerateError, generate
from adaflash_jax.model.checkpoint import CheckpointError, load_target
from adaflash_jax.tokenizer import (
    CHATML_TEMPLATE,
    Tokenizer,
    TokenizerError,
    write_byte_tokenizer,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", help="HF model dir (default: the embedded default target)")
    p.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="e.g. 1,2,3 (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return p.parse_args(argv)


def default_target_dir() -> str:
    if importlib.util.find_spec("adaflash_jax.embedded") is not None:
        from adaflash_jax.embedded import default_target_dir as embedded_dir

        return os.fspath(embedded_dir())
    return random_tiny_target_dir()


def random_tiny_target_dir() -> str:
    """PLACEHOLDER until the embedded target exists: a tiny random Qwen3 + byte tokenizer."""
    from flax import nnx

    from adaflash_jax.model.checkpoint import save_target
    from adaflash_jax.model.config import TargetConfig
    from adaflash_jax.model.target import TargetLM

    cache = os.environ.get("ADAFLASH_CACHE", os.path.expanduser("~/.cache/adaflash_jax"))
    path = os.path.join(cache, "random_tiny")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        vocab = write_byte_tokenizer(path, chat_template=CHATML_TEMPLATE)
        cfg = TargetConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            eos_token_id=256,
        )
        save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), path)
    return path


def build_requests(args, tok: Tokenizer | None) -> list[list[int]]:
    """Token-id prompts from --prompt (tokenized, optionally chat-templated) and --prompt-ids."""
    if args.prompt and tok is None:
        raise SystemExit("--prompt needs a tokenizer.json in the target dir; use --prompt-ids")
    prompts = [
        tok.encode_chat([{"role": "user", "content": t}]) if args.chat else tok.encode(t)
        for t in args.prompt
    ]
    prompts += [[int(x) for x in s.split(",") if x.strip()] for s in args.prompt_ids]
    if not prompts:
        raise SystemExit("give at least one --prompt or --prompt-ids")
    return prompts


def print_results(args, tok: Tokenizer | None, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs):
        text = tok.decode(out) if tok is not None else None
        if args.json:
            print(json.dumps({"prompt_ids": prompt, "output_ids": out, "text": text}))
        else:
            print(f"[{len(prompt)} prompt tokens] -> {text if text is not None else out}")


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        run(args)
    except (GenerateError, TokenizerError, CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


def run(args) -> None:
    target_dir = args.target or default_target_dir()
    has_tok = os.path.isfile(os.path.join(target_dir, "tokenizer.json"))
    tok = Tokenizer(target_dir) if has_tok else None
    model = load_target(target_dir, dtype=getattr(jnp, args.dtype))
    prompts = build_requests(args, tok)
    eos = tok.eos_token_ids if tok is not None and tok.eos_token_ids else None
    outputs = generate(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        eos_ids=eos,
    )
    print_results(args, tok, prompts, outputs)


if __name__ == "__main__":
    main()

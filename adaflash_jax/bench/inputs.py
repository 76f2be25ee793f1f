"""Benchmark inputs: where the target, the drafters and the prompts come from.

- A distillation run directory (`python -m experiments.distill`): `report.json` names the
  target and the exports (`export/<method>/`: stage1 = the DFlash-style stage-1 drafter,
  adaflash = the product, sft = its comparison); `config.json` names the prompt source.
- Explicit directories (`--target`, `--stage1`, `--adaflash`, `--drafter NAME=DIR`).
- `micro_setup`: a tiny random target (byte tokenizer) and untrained drafters, for tests.
Prompts are the embedded eval prompts per domain (the ones distillation evaluates τ on:
same seeded choice), or a prompt file, encoded like distillation encodes them.
"""

from __future__ import annotations

import json
import os

from adaflash_jax.bench.methods import BenchError
from adaflash_jax.model.presets import target_preset


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def from_run_dir(run_dir: str) -> dict:
    """{"target": dir, "drafters": {name: dir}, "config": run config dict} of a distill run."""
    if not os.path.isdir(run_dir):
        raise BenchError(f"run directory does not exist: {run_dir}")
    cfg_path = os.path.join(run_dir, "config.json")
    config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    report_path = os.path.join(run_dir, "report.json")
    report = _read_json(report_path) if os.path.isfile(report_path) else {}
    drafters = {
        name: path
        for name, path in (report.get("exports") or {}).items()
        if path and os.path.isfile(os.path.join(path, "config.json"))
    }
    export_root = os.path.join(run_dir, "export")
    if os.path.isdir(export_root):  # an unfinished run may have exports but no report yet
        for name in sorted(os.listdir(export_root)):
            path = os.path.join(export_root, name)
            if name not in drafters and os.path.isfile(os.path.join(path, "config.json")):
                drafters[name] = path
    if not drafters:
        raise BenchError(f"{run_dir} has no drafter exports (export/<method>/config.json)")
    target = report.get("target") or config.get("target_path")
    if target is None:
        from adaflash_jax.embedded import default_target_dir

        target = default_target_dir(config.get("embedded_preset", "tiny"), progress=False)
    return {"target": target, "drafters": drafters, "config": config}


def load_models(target_dir: str, drafter_dirs: dict[str, str], *, dtype):
    """(target, {name: drafter}); every drafter is validated against the target."""
    from adaflash_jax.drafter.checkpoint import load_drafter
    from adaflash_jax.model.checkpoint import load_target
    from adaflash_jax.model.config import ConfigError

    target = load_target(target_dir, dtype=dtype)
    drafters = {}
    for name, path in drafter_dirs.items():
        drafter = load_drafter(path, dtype=dtype)
        try:
            drafter.config.validate_against(target.config)
        except ConfigError as e:
            raise BenchError(f"drafter {name!r} ({path}) does not fit the target: {e}") from None
        drafters[name] = drafter
    return target, drafters


def load_prompts(
    target_dir: str,
    *,
    per_domain: int,
    max_len: int,
    preset: str = "tiny",
    prompt_file: str | None = None,
    chat_template: bool = False,
    domains: tuple[str, ...] = (),
    seed: int = 0,
) -> dict[str, list[list[int]]]:
    """{domain: token-id prompts}: `per_domain` per domain, the last `max_len` tokens each."""
    from adaflash_jax.distill import prompts as P
    from adaflash_jax.tokenizer import Tokenizer

    if not os.path.isfile(os.path.join(target_dir, "tokenizer.json")):
        raise BenchError(f"{target_dir} has no tokenizer.json to encode the prompts")
    if prompt_file is not None:
        found = P.read_prompts(prompt_file)
    else:
        from adaflash_jax import embedded

        found = P.from_records(embedded.eval_prompts(preset=preset))
    chosen = P.per_domain(found, per_domain, seed=seed, domains=domains)
    ids = P.encode(chosen, Tokenizer(target_dir), chat_template=chat_template, max_len=max_len)
    out: dict[str, list[list[int]]] = {}
    for p, tokens in zip(chosen, ids):
        out.setdefault(p.domain, []).append(tokens)
    return out


def micro_setup(root: str, *, block_size: int = 4) -> dict:
    """A tiny random target (byte tokenizer, V 260) and two untrained drafters under `root`
    (reused when present): seconds to build, for tests and smoke runs."""
    from flax import nnx

    from adaflash_jax.drafter.checkpoint import save_drafter
    from adaflash_jax.drafter.init import drafter_for_target
    from adaflash_jax.model.checkpoint import save_target
    from adaflash_jax.model.target import TargetLM
    from adaflash_jax.tokenizer import write_byte_tokenizer

    target = os.path.join(root, "target")
    if not os.path.isfile(os.path.join(target, "config.json")):
        vocab = write_byte_tokenizer(target)
        cfg = target_preset("test", vocab_size=vocab, max_position_embeddings=256, eos_token_id=256)
        save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), target)
    drafters = {}
    for seed, name in enumerate(("stage1", "adaflash")):
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, "config.json")):
            d = drafter_for_target(
                target, num_layers=1, block_size=block_size, num_features=2, seed=seed
            )
            save_drafter(d, path, dtype=None)
        drafters[name] = path
    return {"target": target, "drafters": drafters, "config": {}}

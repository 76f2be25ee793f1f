"""Everything a run resolves before it computes: target, tokenizer, drafter shape, mesh, prompts.

`prepare` fails fast, naming the config field, on a mesh that does not fit the devices, a
block size the drafter (or the imported export) does not support, a mask token outside the
vocab, feature layers the target lacks, or prompt files that do not parse. The embedded
default target is the one exception: its vocabulary exists only once it is built, so it is
built (or found in the cache) first.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

import jax
from jax.sharding import Mesh

from adaflash_jax.distill import prompts as P
from adaflash_jax.distill.checks import check_runtime
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import run_drafter_config, run_mesh
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.hf_config import config_from_hf
from adaflash_jax.drafter.init import find_mask_token_id
from adaflash_jax.io import fs
from adaflash_jax.model.config import ConfigError, TargetConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
    cfg: RunConfig
    run_dir: str
    target_dir: str
    target_cfg: TargetConfig
    tokenizer: object | None
    drafter_cfg: DrafterConfig
    mesh_shape: tuple[int, int, int]
    eos_ids: tuple[int, ...]
    pad_id: int
    train_prompts: list[P.Prompt]
    eval_prompts: list[P.Prompt]
    stage2_prompts: list[P.Prompt] = dataclasses.field(default_factory=list)  # pool "fresh"
    # prompt file → the JSONL lines skipped as broken (up to data.max_bad_lines per file)
    skipped_lines: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    progress: bool = True  # training/collection progress bars (process 0 only)

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def mesh(self) -> Mesh:
        from adaflash_jax.train.mesh import make_mesh

        return make_mesh(*self.mesh_shape)

    def path(self, *parts: str) -> str:
        return "/".join((self.run_dir, *parts))


def encode_prompts(cfg: RunConfig, tokenizer, prompts, long_prompts: str | None = None):
    """`prompts` as token ids (`prompts.Encoded`) under the run's data settings
    (`long_prompts`: the config's unless given)."""
    d = cfg.data
    return P.encode(
        prompts,
        tokenizer,
        chat_template=d.chat_template,
        max_len=d.max_prompt_len,
        enable_thinking=d.enable_thinking,
        long_prompts=long_prompts or d.long_prompts,
    )


def default_run_dir(cfg: RunConfig) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.name}-{stamp}")


def _target_dir(cfg: RunConfig, progress: bool) -> str:
    if cfg.target_path is not None:
        path = os.path.expanduser(cfg.target_path)
        if not os.path.isdir(path):
            raise ConfigError(f"target_path {cfg.target_path} is not a directory")
        return path
    from adaflash_jax.embedded import default_target_dir

    return default_target_dir(cfg.embedded_preset, progress=progress)


def _drafter_config(cfg: RunConfig, target: TargetConfig, mask_token_id: int) -> DrafterConfig:
    d = cfg.draft
    if d.init_from is not None:
        path = os.path.join(d.init_from, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"draft.init_from {d.init_from} has no config.json")
        with open(path) as f:
            raw = json.load(f)
        dcfg = config_from_hf(raw, with_length_head=True)
        if dcfg.block_size != d.block_size:
            raise ConfigError(
                f"draft.block_size {d.block_size} does not match the imported drafter's "
                f"block_size {dcfg.block_size} ({d.init_from}); set draft.block_size="
                f"{dcfg.block_size}"
            )
        # A trained acceptance network is kept as it is (its width is fixed); an import
        # without one gets a fresh network of the run's width (pipeline passes it on).
        accept = dcfg.length_head.accept_dim or d.accept_dim
        if d.accept_dim != accept:
            raise ConfigError(
                f"draft.accept_dim {d.accept_dim} does not match the imported drafter "
                f"({d.init_from}: its acceptance network is {accept} wide); set "
                f"draft.accept_dim={accept}"
            )
        dcfg = config_from_hf(raw, with_length_head=True, accept_dim=accept)
    else:
        dcfg = run_drafter_config(cfg, target, mask_token_id)
    try:
        dcfg.validate_against(target)
    except ConfigError as e:
        raise ConfigError(f"draft: {e}") from None
    return dcfg


def _found_prompts(cfg: RunConfig, split: str, skipped: dict) -> list[P.Prompt]:
    """Every prompt of a split's source: its file, or the embedded corpus's split. A file's
    skipped broken lines go into `skipped` (file → line numbers)."""
    path = {
        "train": cfg.data.train_prompts,
        "eval": cfg.data.eval_prompts,
        "stage2": cfg.data.stage2_prompts or cfg.data.train_prompts,
    }[split]
    if path is not None:
        found = P.read_prompts(path, max_bad_lines=cfg.data.max_bad_lines)
        if found.skipped_lines:
            skipped[path] = found.skipped_lines
        return found
    if cfg.target_path is None:
        from adaflash_jax import embedded

        get = embedded.eval_prompts if split == "eval" else embedded.train_prompts
        return P.from_records(get(preset=cfg.embedded_preset))
    name = "train" if split == "stage2" else split
    raise ConfigError(
        f"data.{name}_prompts must name a prompt file when target_path is set "
        "(the embedded prompts belong to the embedded target)"
    )


def _prompts(cfg: RunConfig, split: str, skipped: dict) -> list[P.Prompt]:
    found = _found_prompts(cfg, split, skipped)
    count = cfg.data.train_per_domain if split == "train" else cfg.data.eval_per_domain
    return P.per_domain(found, count, seed=cfg.seed, domains=cfg.data.domains)


def stage2_pool_size(cfg: RunConfig) -> int:
    """Prompts stage 2 needs for every round to see new ones (0 when it draws none)."""
    s2 = cfg.stage2
    trained = [m for m in s2.methods if m != "stage1_long"]
    if s2.pool != "fresh" or not s2.rounds or not trained:
        return 0
    return s2.rounds * s2.prompts_per_round


def _stage2_prompts(cfg: RunConfig, train: list[P.Prompt], skipped: dict) -> list[P.Prompt]:
    """The "fresh" pool: prompts of the stage-2 source that stage 1 did not use, balanced
    over domains, `rounds × prompts_per_round` of them when the source has that many."""
    need = stage2_pool_size(cfg)
    if not need:
        return []
    used = {P.identity(p) for p in train}
    left = [p for p in _found_prompts(cfg, "stage2", skipped) if P.identity(p) not in used]
    domains = cfg.data.domains or tuple(dict.fromkeys(p.domain for p in left))
    per = -(-need // max(len(domains), 1))
    pool = P.per_domain(left, per, seed=cfg.seed + 1, domains=domains) if left else []
    if 0 < len(pool) < need and jax.process_index() == 0:
        print(
            f"warning: the stage-2 pool has {len(pool)} prompts not used by stage 1, the "
            f"rounds need {need}: later rounds repeat prompts",
            flush=True,
        )
    return pool


def prepare(cfg: RunConfig, *, run_dir: str | None = None, progress: bool = True) -> Context:
    """`progress` here covers building the embedded target; `Context.progress` the rest."""
    mesh_shape = run_mesh(cfg, jax.device_count())  # before anything is built
    if cfg.draft.init_from is not None and not os.path.isdir(cfg.draft.init_from):
        raise ConfigError(f"draft.init_from {cfg.draft.init_from} is not a directory")
    target_dir = _target_dir(cfg, progress)
    target_cfg = TargetConfig.from_pretrained(target_dir)
    tokenizer = None
    if os.path.isfile(os.path.join(target_dir, "tokenizer.json")):
        from adaflash_jax.tokenizer import Tokenizer

        tokenizer = Tokenizer(target_dir)
    mask = cfg.draft.mask_token_id
    if mask is None and tokenizer is not None:
        mask = tokenizer.mask_token_id
    if mask is None:
        mask = find_mask_token_id(target_dir)
    if cfg.draft.init_from is not None and cfg.draft.mask_token_id is None:
        with open(os.path.join(cfg.draft.init_from, "config.json")) as f:
            raw = json.load(f)
        mask = (raw.get("dflash_config") or {}).get("mask_token_id", mask)
    mesh_shape = check_runtime(
        cfg, num_devices=jax.device_count(), target=target_cfg, mask_token_id=mask
    )
    drafter_cfg = _drafter_config(cfg, target_cfg, mask)
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
    eos = eos or target_cfg.eos_token_ids
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    pad = pad if pad is not None else (eos[0] if eos else 0)
    skipped: dict[str, tuple[int, ...]] = {}
    train, evals = _prompts(cfg, "train", skipped), _prompts(cfg, "eval", skipped)
    pool = _stage2_prompts(cfg, train, skipped)
    if cfg.stage2.pool == "fresh" and stage2_pool_size(cfg) and not pool:
        raise ConfigError(
            "stage2.pool 'fresh' found no prompts that stage 1 did not use: set "
            "data.stage2_prompts, lower data.train_per_domain, or stage2.pool='stage1'"
        )
    if tokenizer is None and any(p.text or p.messages for p in train + evals + pool):
        raise ConfigError(f"target_path {target_dir} has no tokenizer.json to encode the prompts")
    return Context(
        cfg=cfg,
        run_dir=fs.absolute(run_dir or cfg.run_dir or default_run_dir(cfg)),
        target_dir=target_dir,
        target_cfg=target_cfg,
        tokenizer=tokenizer,
        drafter_cfg=drafter_cfg,
        mesh_shape=mesh_shape,
        eos_ids=tuple(int(e) for e in eos),
        pad_id=int(pad),
        train_prompts=train,
        eval_prompts=evals,
        skipped_lines=skipped,
        stage2_prompts=pool,
    )

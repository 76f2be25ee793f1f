"""The embedded default target: built once (corpus -> tokenizer -> pretrain -> HF dir), cached.

Cache location: `cache_dir` argument, else $ADAFLASH_CACHE, else ~/.cache/adaflash_jax.
The directory name holds the preset, CORPUS_VERSION, the Python minor version (the corpus
is read from the running interpreter's standard library, which differs between versions)
and a hash of the preset's full config, so retuning a preset never reuses a stale build.
A `COMPLETE` marker is written LAST; a directory without it is an interrupted build, which
the next call resumes from its orbax checkpoint (the result is the same as an uninterrupted
build). A file lock keeps concurrent callers from building the same target twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import sys
import time

from adaflash_jax.data.corpus import CORPUS_VERSION, DOMAINS, build_corpus

ENV_VAR = "ADAFLASH_CACHE"
COMPLETE_MARKER = "COMPLETE"


def cache_root(cache_dir: str | os.PathLike | None = None) -> str:
    if cache_dir is not None:
        return os.path.abspath(os.fspath(cache_dir))
    env = os.environ.get(ENV_VAR)
    return os.path.abspath(env) if env else os.path.expanduser("~/.cache/adaflash_jax")


def target_dir_name(preset: str, steps: int | None = None) -> str:
    """target-<preset>-<corpus version>-py<XY>-<hash of the preset's full config>[-steps<N>]."""
    from adaflash_jax.train.presets import get_preset

    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    blob = json.dumps(dataclasses.asdict(get_preset(preset)), sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:8]
    suffix = f"-steps{steps}" if steps is not None else ""
    return f"target-{preset}-{CORPUS_VERSION}-{py}-{digest}{suffix}"


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), COMPLETE_MARKER))


@contextlib.contextmanager
def _file_lock(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_target_dir(
    preset: str = "tiny",
    cache_dir: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    mesh=None,
    progress: bool = True,
) -> str:
    """Path of the HF directory of the embedded `preset` target, building it if needed."""
    from adaflash_jax.train.presets import get_preset

    cfg = get_preset(preset)
    if steps == cfg.steps:
        steps = None  # the preset's own length shares the default cache entry
    path = os.path.join(cache_root(cache_dir), target_dir_name(preset, steps))
    if is_complete(path):
        return path
    with _file_lock(f"{path}.lock"):
        if is_complete(path):  # another process finished it while we waited
            return path
        from adaflash_jax.train.pretrain import run_pretrain

        metrics = run_pretrain(
            cfg,
            path,
            steps=steps,
            resume=True,
            mesh=mesh,
            keep_checkpoints=False,
            progress=progress,
        )
        if metrics["status"] != "done":
            raise RuntimeError(f"building the embedded target stopped early: {metrics['status']}")
        marker = {
            "preset": preset,
            "corpus_version": CORPUS_VERSION,
            "corpus_fingerprint": metrics.get("corpus_fingerprint"),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        tmp = os.path.join(path, f"{COMPLETE_MARKER}.tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f, indent=2)
        os.replace(tmp, os.path.join(path, COMPLETE_MARKER))
    return path


@functools.cache
def _corpus(preset: str):
    from adaflash_jax.train.presets import get_preset

    return build_corpus(get_preset(preset).corpus)


def _prompts(split: str, domain: str | None, preset: str) -> list[dict[str, str]]:
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; domains: {DOMAINS}")
    return [dict(p) for p in _corpus(preset).prompts(split, domain)]


def eval_prompts(domain: str | None = None, preset: str = "tiny") -> list[dict[str, str]]:
    """Held-out {"domain", "prompt"} records (>= 64 per domain) of the preset's corpus."""
    return _prompts("eval", domain, preset)


def train_prompts(domain: str | None = None, preset: str = "tiny") -> list[dict[str, str]]:
    """Training-split {"domain", "prompt"} records, e.g. for distillation rollouts."""
    return _prompts("train", domain, preset)


def long_eval_prompts(per_domain: int, preset: str = "tiny") -> list[dict[str, str]]:
    """Held-out {"domain", "prompt"} records whose documents are the longest of their domain,
    `per_domain` per domain, longest first (ties by key): the long-response prompt set of τ by
    position (distill/evaluation.py)."""
    out = []
    for domain in DOMAINS:
        docs = [d for d in _corpus(preset).docs(domain, "eval") if d.prompt]
        docs.sort(key=lambda d: (-len(d.text), d.key))
        out += [{"domain": d.domain, "prompt": d.prompt} for d in docs[:per_domain]]
    return out

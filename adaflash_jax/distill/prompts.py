"""Prompt datasets for regeneration, on-policy collection and evaluation.

Accepted files:
- JSONL (or a JSON list) of records with `prompt` (a string), or ShareGPT-style
  `conversations` ([{"from": "human"|"gpt"|"system", "value"}]) or `messages`
  ([{"role", "content"}]); the conversation up to its first assistant turn is the prompt.
  An optional `domain` field groups prompts for per-domain evaluation.
- Plain text (any other extension): one prompt per non-empty line.

`encode` turns records into token ids, through the tokenizer's chat template when asked
(a plain prompt becomes one user turn). Prompts longer than the limit keep their LAST
tokens, the context the response continues from. `shard` gives each process its share for
host-local pipelines; a grain `MapDataset` view is available where grain is installed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence

import numpy as np

from adaflash_jax.io import fs

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_SHAREGPT_ROLES |= {"system": "system", "chatgpt": "assistant", "bing": "assistant"}


class PromptError(ValueError):
    """A prompt file or record that cannot be used."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    domain: str
    text: str | None = None  # a plain prompt
    messages: tuple[dict, ...] | None = None  # a conversation ending before the assistant

    def __post_init__(self):
        if (self.text is None) == (self.messages is None):
            raise PromptError("a prompt has exactly one of text / messages")


def _messages_from(record: dict, where: str) -> tuple[dict, ...]:
    if "messages" in record:
        turns = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    else:
        turns = []
        for m in record["conversations"]:
            role = _SHAREGPT_ROLES.get(str(m.get("from", m.get("role"))).lower())
            if role is None:
                raise PromptError(f"{where}: unknown ShareGPT speaker {m.get('from')!r}")
            turns.append({"role": role, "content": m.get("value", m.get("content", ""))})
    cut = next((i for i, t in enumerate(turns) if t["role"] == "assistant"), len(turns))
    turns = turns[:cut]
    if not any(t["role"] == "user" for t in turns):
        raise PromptError(f"{where}: the conversation has no user turn before the assistant")
    return tuple(turns)


def parse_record(record: dict, *, default_domain: str, where: str = "record") -> Prompt:
    if not isinstance(record, dict):
        raise PromptError(f"{where}: a prompt record is a JSON object, got {type(record).__name__}")
    domain = str(record.get("domain", default_domain))
    if isinstance(record.get("prompt"), str):
        return Prompt(domain=domain, text=record["prompt"])
    if "messages" in record or "conversations" in record:
        return Prompt(domain=domain, messages=_messages_from(record, where))
    raise PromptError(f"{where}: needs `prompt`, `messages` or `conversations`")


class PromptList(list):
    """Prompts read from a file, with the line numbers of the JSONL lines skipped as broken."""

    skipped_lines: tuple[int, ...] = ()


LONG_PROMPTS = ("truncate", "skip")


class Encoded(list):
    """Token ids per prompt kept, with how many prompts were over the length budget: cut to
    it (`truncated`) or left out (`skipped`); `kept` indexes the prompts kept, in order."""

    truncated: int = 0
    skipped: int = 0
    kept: tuple[int, ...] = ()


def read_prompts(
    path: str | os.PathLike, *, default_domain: str | None = None, max_bad_lines: int = 0
) -> PromptList:
    """Every prompt of a file (format chosen by extension, see the module docstring). A
    JSONL line that is not JSON, or not a prompt record, is broken: up to `max_bad_lines`
    of them are skipped (their line numbers kept in `skipped_lines`), more refuse the file
    with one line naming it and the first of them."""
    path = os.fspath(path)  # local or gs://
    if not fs.exists(path) or fs.isdir(path):
        raise FileNotFoundError(f"prompt file does not exist: {path}")
    domain = default_domain or os.path.splitext(os.path.basename(path))[0]
    ext = os.path.splitext(path)[1].lower()
    with io.StringIO(fs.read_text(path)) as f:
        if ext == ".json":
            records = json.load(f)
            if not isinstance(records, list):
                raise PromptError(f"{path}: a .json prompt file must hold a list of records")
        elif ext == ".jsonl":
            return _read_jsonl(f, path, domain, max_bad_lines)
        else:
            lines = [Prompt(domain=domain, text=line.rstrip("\n")) for line in f if line.strip()]
            return PromptList(lines)
    return PromptList(
        parse_record(r, default_domain=domain, where=f"{path} record {i}")
        for i, r in enumerate(records)
    )


def _read_jsonl(f, path: str, domain: str, max_bad_lines: int) -> PromptList:
    out, bad, first_error = PromptList(), [], None
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_record(json.loads(line), default_domain=domain, where=f"line {n}"))
        except json.JSONDecodeError as e:
            bad.append(n)
            first_error = first_error or f"line {n}: not JSON ({e})"
        except PromptError as e:
            bad.append(n)
            first_error = first_error or " ".join(str(e).split())
    if len(bad) > max_bad_lines:
        shown = ", ".join(map(str, bad[:10])) + (
            f" (+{len(bad) - 10} more)" if len(bad) > 10 else ""
        )
        raise PromptError(
            f"{path}: {len(bad)} broken lines ({shown}; {first_error}); data.max_bad_lines is "
            f"{max_bad_lines}: to skip them, set it to {len(bad)} (experiments.distill: "
            f"--set data.max_bad_lines={len(bad)})"
        )
    out.skipped_lines = tuple(bad)
    return out


def identity(p: Prompt) -> str:
    """A hashable key of a prompt's content (to keep prompt pools disjoint)."""
    return json.dumps([p.domain, p.text, p.messages], sort_keys=True)


def from_records(records: Sequence[dict], default_domain: str = "default") -> list[Prompt]:
    """Prompts from in-memory records ({"domain", "prompt"} as the embedded corpus gives)."""
    return [parse_record(r, default_domain=default_domain) for r in records]


def per_domain(
    prompts: Sequence[Prompt], count: int, *, seed: int, domains: Sequence[str] = ()
) -> list[Prompt]:
    """Up to `count` prompts of each domain (seeded choice, domains in first-seen order)."""
    order = list(dict.fromkeys(p.domain for p in prompts))
    if domains:
        missing = [d for d in domains if d not in order]
        if missing:
            raise PromptError(f"no prompts for domains {missing}; available: {order}")
        order = list(domains)
    out = []
    for d in order:
        pool = [p for p in prompts if p.domain == d]
        pick = np.random.default_rng([seed, len(pool)]).permutation(len(pool))[:count]
        out.extend(pool[i] for i in sorted(pick))
    return out


def encode(
    prompts: Sequence[Prompt],
    tokenizer,
    *,
    chat_template: bool,
    max_len: int,
    enable_thinking: bool = False,
    long_prompts: str = "truncate",
) -> Encoded:
    """Token ids per prompt. A prompt longer than `max_len` keeps its last tokens, counted in
    `truncated` (`long_prompts="truncate"`), or is left out, counted in `skipped` ("skip");
    `kept` lists the indices of the prompts kept. With the chat template, `enable_thinking`
    goes to it (the Qwen3 / Qwen3.5 templates branch on it)."""
    if long_prompts not in LONG_PROMPTS:
        raise PromptError(f"long_prompts must be one of {LONG_PROMPTS}, got {long_prompts!r}")
    out, kept = Encoded(), []
    for i, p in enumerate(prompts):
        if chat_template:
            messages = list(p.messages or ({"role": "user", "content": p.text},))
            ids = tokenizer.encode_chat(
                messages, add_generation_prompt=True, enable_thinking=enable_thinking
            )
        else:
            text = p.text if p.text is not None else "\n".join(m["content"] for m in p.messages)
            ids = tokenizer.encode(text)
        if not ids:
            raise PromptError(f"a {p.domain!r} prompt encodes to no tokens")
        if len(ids) > max_len and long_prompts == "skip":
            out.skipped += 1
            continue
        out.truncated += len(ids) > max_len
        out.append(list(ids[-max_len:]))
        kept.append(i)
    out.kept = tuple(kept)
    return out


def shard(items: Sequence, process_index: int, process_count: int) -> list:
    """This process's share (every `process_count`-th item)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process {process_index} outside 0..{process_count - 1}")
    return list(items[process_index::process_count])


def grain_dataset(prompt_ids: Sequence[Sequence[int]], process_index: int, process_count: int):
    """A grain `MapDataset` over this process's encoded prompts (grain imported lazily)."""
    import grain

    return grain.MapDataset.source(list(prompt_ids))[process_index::process_count]

"""HuggingFace tokenizer directories: `tokenizer.json` through `tokenizers`, special tokens
from `tokenizer_config.json` / `generation_config.json`, chat templates through jinja2.

The chat template is rendered the way `transformers` does it: a sandboxed jinja2
environment with `trim_blocks`/`lstrip_blocks`, a `raise_exception` helper, a `tojson`
filter, a `strftime_now` helper (today's date, which gpt-oss's harmony template writes into
its system message, as Llama 3.1's does) and the `bos_token` / `eos_token` variables. Any
other keyword goes to the template: gpt-oss's reads `reasoning_effort` ("low", "medium", the
default, or "high"), Qwen3's `enable_thinking`.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

MASK_TOKEN_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]")


class TokenizerError(ValueError):
    """A tokenizer directory that is missing pieces or is inconsistent."""


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{path} is not valid JSON ({e})") from None


def _token_text(entry) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(entry, Mapping):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _raise_exception(message: str):
    raise TokenizerError(f"chat template error: {message}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class Tokenizer:
    """Text ↔ token ids for one model directory."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory does not exist: {path}")
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))

        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.chat_template = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        if self.chat_template is None:
            jinja_file = os.path.join(path, "chat_template.jinja")
            if os.path.isfile(jinja_file):
                with open(jinja_file) as f:
                    self.chat_template = f.read()

        self.bos_token_id = self._id_or_none(self.bos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        # generation_config wins (it lists every stop token, e.g. Llama-3's <|eot_id|>).
        eos = gen.get("eos_token_id")
        if eos is None and self.eos_token is not None:
            eos = self._id_or_none(self.eos_token)
        if eos is None:
            eos = model_cfg.get("eos_token_id")
        self.eos_token_ids: tuple[int, ...] = (
            () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(map(int, eos))
        )
        mask_text = _token_text(cfg.get("mask_token"))
        candidates = (mask_text,) if mask_text else MASK_TOKEN_CANDIDATES
        self.mask_token_id = next(
            (i for i in map(self._id_or_none, candidates) if i is not None), None
        )

    def _id_or_none(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs,
    ) -> str:
        """Renders `messages` ([{"role", "content"}, ...]) with the directory's template."""
        if not self.chat_template:
            raise TokenizerError(f"{self.path} has no chat_template (tokenizer_config.json)")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            template = env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template of {self.path} does not parse: {e}") from None
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:  # e.g. a helper or variable the template needs
            raise TokenizerError(f"chat template of {self.path} failed to render: {e}") from None

    def encode_chat(self, messages, *, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Template then encode; the template already holds any BOS, so none is added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)


def write_byte_tokenizer(
    path: str | os.PathLike,
    *,
    special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"),
    eos_token: str = "<|endoftext|>",
    chat_template: str | None = None,
) -> int:
    """Writes a byte-level tokenizer (256 byte ids, then the special tokens) for tiny random
    targets and tests; returns its vocabulary size. Needs no training and no network."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    byte_chars = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; order ids by byte value.
    mapping = _byte_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg: dict[str, Any] = {"eos_token": eos_token, "pad_token": eos_token}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

"""The embedded multi-domain corpus: code, prose, math and dialogue, split deterministically.

Every document gets a stable key (source path + qualified name, topic, or generator index);
its split is a hash of (CORPUS_VERSION, domain, key), so it never depends on which other
documents were selected, on the machine, or on the order of discovery. Dialogue documents
inherit the split of the item they were derived from, so a held-out function is held out
in every domain that shows it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from collections.abc import Iterable

from adaflash_jax.data import dialogue, math_gen, sources

# Bump when any document or prompt changes (it keys the embedded-target cache). The split
# salt stays fixed across versions so held-out sets remain comparable.
CORPUS_VERSION = "stdlib-mix-v2"
_SPLIT_SALT = "stdlib-mix-v1"
DOMAINS = ("code", "prose", "math", "dialogue")
SPLITS = ("train", "eval")


class CorpusError(ValueError):
    """A corpus that cannot serve its purpose (e.g. too few held-out prompts)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    code_bytes: int = 1_400_000  # stdlib source bytes read for the code domain
    prose_bytes: int = 2_500_000  # stdlib source bytes read for docstrings (prose domain)
    reference_docs: bool = True  # pydoc language-reference topics and LICENSE.txt (prose)
    math_problems: int = 2500
    dialogue_fraction: float = 0.2  # share of code/prose items also turned into a dialogue
    dialogue_math: int = 600
    eval_fraction: float = 0.1
    seed: int = 0
    min_eval_prompts: int = 64  # per domain; 0 disables the check (small test corpora)

    def __post_init__(self):
        for name in ("code_bytes", "prose_bytes", "math_problems", "dialogue_math"):
            if getattr(self, name) < 0:
                raise ValueError(f"CorpusConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(
                f"CorpusConfig.eval_fraction must be in (0, 1), got {self.eval_fraction}"
            )
        if not 0.0 <= self.dialogue_fraction <= 1.0:
            raise ValueError(
                f"CorpusConfig.dialogue_fraction must be in [0, 1], got {self.dialogue_fraction}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Document:
    domain: str
    key: str
    text: str
    prompt: str  # "" when the document has no natural prompt
    split: str


def split_of(domain: str, key: str, eval_fraction: float) -> str:
    u = sources.stable_hash(_SPLIT_SALT, "split", domain, key) / 2.0**64
    return "eval" if u < eval_fraction else "train"


def _fraction_pick(tag: str, key: str, fraction: float) -> bool:
    return sources.stable_hash(_SPLIT_SALT, tag, key) / 2.0**64 < fraction


@dataclasses.dataclass(frozen=True)
class Corpus:
    config: CorpusConfig
    documents: tuple[Document, ...]
    metadata: dict

    def docs(self, domain: str | None = None, split: str | None = None) -> list[Document]:
        if domain is not None and domain not in DOMAINS:
            raise ValueError(f"unknown domain {domain!r}; domains: {DOMAINS}")
        if split is not None and split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; splits: {SPLITS}")
        return [
            d
            for d in self.documents
            if (domain is None or d.domain == domain) and (split is None or d.split == split)
        ]

    def texts(self, split: str, domain: str | None = None) -> list[str]:
        return [d.text for d in self.docs(domain, split)]

    def prompts(self, split: str, domain: str | None = None) -> list[dict[str, str]]:
        """JSONL-able {"domain", "prompt"} records, in a stable order (domain, then key)."""
        return [
            {"domain": d.domain, "prompt": d.prompt} for d in self.docs(domain, split) if d.prompt
        ]

    def write(self, directory: str | os.PathLike) -> None:
        """metadata.json, docs_<split>.jsonl and prompts_<split>.jsonl under `directory`."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            json.dump(self.metadata, f, indent=2)
        for split in SPLITS:
            _write_jsonl(
                os.path.join(directory, f"docs_{split}.jsonl"),
                (dataclasses.asdict(d) for d in self.docs(split=split)),
            )
            _write_jsonl(os.path.join(directory, f"prompts_{split}.jsonl"), self.prompts(split))


def _write_jsonl(path: str, records: Iterable[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_prompts(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_corpus(config: CorpusConfig | None = None) -> Corpus:
    cfg = config or CorpusConfig()
    root = sources.stdlib_dir()
    code_files = sources.select_files(root, "code", cfg.code_bytes)
    prose_files = sources.select_files(root, "prose", cfg.prose_bytes)
    raw = {
        "code": sources.code_documents(root, [p for p, _ in code_files]),
        "prose": sources.docstring_documents(root, [p for p, _ in prose_files]),
        "math": math_gen.math_documents(cfg.seed, cfg.math_problems),
    }
    reference_provenance = []
    if cfg.reference_docs:
        ref_docs, reference_provenance = sources.reference_documents(root)
        raw["prose"] += ref_docs

    def make(domain: str, doc: sources.RawDoc, split: str) -> Document:
        return Document(domain=domain, key=doc.key, text=doc.text, prompt=doc.prompt, split=split)

    documents = [
        make(domain, d, split_of(domain, d.key, cfg.eval_fraction))
        for domain in ("code", "prose", "math")
        for d in raw[domain]
    ]
    # Dialogue: derived items keep their source's split; fresh math uses its own stream.
    for domain, derive in (("code", dialogue.code_dialogue), ("prose", dialogue.prose_dialogue)):
        for d in raw[domain]:
            if d.summary and _fraction_pick("dialogue", d.key, cfg.dialogue_fraction):
                split = split_of(domain, d.key, cfg.eval_fraction)
                documents.append(make("dialogue", derive(d), split))
    for i in range(cfg.dialogue_math):
        d = dialogue.math_dialogue(cfg.seed + 1, i)
        documents.append(make("dialogue", d, split_of("dialogue", d.key, cfg.eval_fraction)))

    documents.sort(key=lambda d: (DOMAINS.index(d.domain), d.key))
    corpus = Corpus(
        config=cfg,
        documents=tuple(documents),
        metadata=_metadata(cfg, root, code_files, prose_files, reference_provenance, documents),
    )
    _check(corpus)
    return corpus


def _metadata(cfg, root, code_files, prose_files, reference_provenance, documents) -> dict:
    stats = {}
    for domain in DOMAINS:
        for split in SPLITS:
            docs = [d for d in documents if d.domain == domain and d.split == split]
            stats.setdefault(domain, {})[split] = {
                "documents": len(docs),
                "bytes": sum(len(d.text.encode()) for d in docs),
                "prompts": sum(1 for d in docs if d.prompt),
            }
    digest = hashlib.sha256()
    for d in documents:
        digest.update(f"{d.domain}\x1f{d.key}\x1f{d.split}\x1f{d.prompt}\x1f{d.text}\x1e".encode())
    return {
        "corpus_version": CORPUS_VERSION,
        "config": dataclasses.asdict(cfg),
        "python": platform.python_version(),
        "stdlib_dir": root,
        "fingerprint": digest.hexdigest(),
        "stats": stats,
        "sources": {
            "code": [{"path": p, "bytes": b} for p, b in code_files],
            "prose_docstrings": [{"path": p, "bytes": b} for p, b in prose_files],
            "prose_reference": reference_provenance,
            "math": {"generator": "adaflash_jax.data.math_gen", "seed": cfg.seed},
            "dialogue": {
                "derived_from": ["code", "prose"],
                "math_stream_seed": cfg.seed + 1,
                "chat_template": "adaflash_jax.data.dialogue.CHAT_TEMPLATE",
            },
        },
    }


def _check(corpus: Corpus) -> None:
    for domain in DOMAINS:
        stats = corpus.metadata["stats"][domain]
        for split in SPLITS:
            if stats[split]["documents"] == 0:
                raise CorpusError(f"domain {domain!r} has no {split} documents; enlarge the config")
        need = corpus.config.min_eval_prompts
        if stats["eval"]["prompts"] < need:
            raise CorpusError(
                f"domain {domain!r} has {stats['eval']['prompts']} held-out prompts, "
                f"fewer than min_eval_prompts={need}"
            )

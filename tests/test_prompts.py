"""Prompt files: JSONL `prompt`, ShareGPT `conversations`, `messages`, plain text; chat
template; truncation keeps the end; per-domain choice; per-host shards."""

import json

import pytest
from doubles import THINKING_TEMPLATE

from adaflash_jax.distill import prompts as P
from adaflash_jax.tokenizer import CHATML_TEMPLATE, Tokenizer, write_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    write_byte_tokenizer(path, chat_template=CHATML_TEMPLATE)
    return Tokenizer(path)


def test_read_all_formats(tmp_path):
    records = [
        {"prompt": "plain one", "domain": "code"},
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "again"},
            ]
        },
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path = tmp_path / "mix.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    got = P.read_prompts(str(path))
    assert [p.domain for p in got] == ["code", "mix", "mix"]  # default: the file's stem
    assert got[0].text == "plain one"
    assert [m["role"] for m in got[1].messages] == ["system", "user"]  # cut at the assistant
    assert got[2].messages == ({"role": "user", "content": "q"},)
    txt = tmp_path / "lines.txt"
    txt.write_text("first\n\nsecond\n")
    assert [p.text for p in P.read_prompts(str(txt))] == ["first", "second"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(P.PromptError, match="line 1: needs `prompt`"):
        P.read_prompts(str(bad))
    bad.write_text(json.dumps({"conversations": [{"from": "gpt", "value": "x"}]}) + "\n")
    with pytest.raises(P.PromptError, match="no user turn"):
        P.read_prompts(str(bad))


def test_encode_chat_template_and_truncation(tokenizer):
    prompts = [P.Prompt(domain="d", text="hello"), P.Prompt(domain="d", text="abcdefgh")]
    chat = P.encode(prompts[:1], tokenizer, chat_template=True, max_len=100)[0]
    assert tokenizer.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = P.encode(prompts, tokenizer, chat_template=False, max_len=3)
    assert tokenizer.decode(plain[1]) == "fgh"  # the end of the prompt is kept


def test_per_domain_and_shard():
    prompts = [P.Prompt(domain=d, text=f"{d}{i}") for d in "ab" for i in range(5)]
    pick = P.per_domain(prompts, 2, seed=0)
    assert [p.domain for p in pick] == ["a", "a", "b", "b"]
    assert pick == P.per_domain(prompts, 2, seed=0)  # seeded
    assert [p.domain for p in P.per_domain(prompts, 9, seed=0, domains=("b",))] == ["b"] * 5
    with pytest.raises(P.PromptError, match="domains"):
        P.per_domain(prompts, 1, seed=0, domains=("c",))
    shards = [P.shard(prompts, i, 3) for i in range(3)]
    assert sorted(p.text for s in shards for p in s) == sorted(p.text for p in prompts)


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_stage2_pool_is_disjoint_from_stage1(tmp_path):
    """The "fresh" pool: prompts stage 1 did not take, rounds × prompts_per_round of them,
    balanced over domains; a separate stage-2 file may hold other domains."""
    from adaflash_jax.distill import config as C
    from adaflash_jax.distill.context import _prompts, _stage2_prompts
    from adaflash_jax.distill.overrides import override

    train = _write(tmp_path / "t.jsonl", [{"domain": d, "prompt": f"{d} {i}"}
                                         for d in ("a", "b") for i in range(10)])  # fmt: skip
    stage2 = C.Stage2Spec(rounds=2, prompts_per_round=4)
    cfg = C.RunConfig(
        target_path=str(tmp_path),
        data=C.DataSpec(train_prompts=train, eval_prompts=train, train_per_domain=3),
        stage2=stage2,
    )
    first = _prompts(cfg, "train", {})
    pool = _stage2_prompts(cfg, first, {})
    assert len(first) == 6 and len(pool) == 8
    assert sorted(p.domain for p in pool) == ["a"] * 4 + ["b"] * 4
    assert not {P.identity(p) for p in pool} & {P.identity(p) for p in first}
    # a separate stage-2 file (another domain: domain adaptation) is used as it is
    other = _write(tmp_path / "s.jsonl", [{"domain": "c", "prompt": f"c {i}"} for i in range(9)])
    cfg = override(cfg, {"data.stage2_prompts": repr(other)})
    pool = _stage2_prompts(cfg, first, {})
    assert len(pool) == 8 and {p.domain for p in pool} == {"c"}
    # the pool "stage1" replays stage 1's sequences: no fresh prompts are drawn
    assert _stage2_prompts(override(cfg, {"stage2.pool": "'stage1'"}), first, {}) == []


def test_thinking_mode_reaches_the_template(tmp_path):
    """A template that branches on `enable_thinking` (as Qwen3 / Qwen3.5's do): distillation
    renders with it off by default (the reference's setting), and on when asked."""
    write_byte_tokenizer(str(tmp_path), chat_template=THINKING_TEMPLATE)
    tok = Tokenizer(str(tmp_path))
    prompt = [P.Prompt(domain="d", text="hi")]
    off = P.encode(prompt, tok, chat_template=True, max_len=99)[0]
    on = P.encode(prompt, tok, chat_template=True, max_len=99, enable_thinking=True)[0]
    assert tok.decode(off, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert tok.decode(on, skip_special_tokens=False).endswith("assistant\n")


def test_broken_jsonl_lines_are_named_or_skipped_and_counted(tokenizer, tmp_path):
    """Lines that are not JSON or not a prompt record: named (file and line numbers) and
    refused past `max_bad_lines`, skipped and kept count of below it; prompts cut to the
    length budget are counted."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok one"}\n{"prompt": "cut\n\n7\n{"prompt": "ok two"}\n')
    with pytest.raises(P.PromptError, match=r"p\.jsonl: 2 broken lines \(2, 4; line 2"):
        P.read_prompts(str(path))
    got = P.read_prompts(str(path), max_bad_lines=2)
    assert [p.text for p in got] == ["ok one", "ok two"] and got.skipped_lines == (2, 4)
    ids = P.encode(got, tokenizer, chat_template=False, max_len=4)
    assert ids.truncated == 2 and all(len(i) == 4 for i in ids)


def test_long_prompts_are_truncated_or_skipped_and_counted(tokenizer):
    """`long_prompts`: "truncate" keeps a long prompt's last tokens, "skip" leaves it out;
    both count it, and `kept` says which prompts remain."""
    prompts = [P.Prompt(domain="d", text=t) for t in ("ab", "abcdefgh", "abc", "abcdef")]
    cut = P.encode(prompts, tokenizer, chat_template=False, max_len=4)
    assert (cut.truncated, cut.skipped, cut.kept) == (2, 0, (0, 1, 2, 3))
    assert cut[1] == tokenizer.encode("abcdefgh")[-4:]
    skip = P.encode(prompts, tokenizer, chat_template=False, max_len=4, long_prompts="skip")
    assert (skip.truncated, skip.skipped, skip.kept) == (0, 2, (0, 2))
    assert list(skip) == [cut[0], cut[2]]
    with pytest.raises(P.PromptError, match="long_prompts"):
        P.encode(prompts, tokenizer, chat_template=False, max_len=4, long_prompts="drop")


def test_skipped_long_prompts_reach_the_report(tokenizer):
    """The pipeline encodes with `data.long_prompts`, keeps the prompts (and domains) of the
    ids it kept, refuses a split left empty, and reports both counts per split."""
    import types

    from adaflash_jax.distill import config as C
    from adaflash_jax.distill import pipeline

    prompts = [P.Prompt(domain=d, text=t) for d, t in (("a", "x"), ("b", "abcdefgh"), ("c", "y"))]
    cfg = C.RunConfig(data=C.DataSpec(max_prompt_len=4, long_prompts="skip"))
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=tokenizer, skipped_lines={})
    ids, kept = pipeline._encode(ctx, prompts, "train")
    assert [p.domain for p in kept] == ["a", "c"] and ids.skipped == 1
    with pytest.raises(C.ConfigError, match="all 1 eval prompts are longer"):
        pipeline._encode(ctx, prompts[1:2], "eval")
    truncating = types.SimpleNamespace(cfg=C.RunConfig(), tokenizer=tokenizer)
    cut, _ = pipeline._encode(truncating, prompts, "eval")
    data = types.SimpleNamespace(
        train_ids=ids, eval_ids=cut, stage2_ids=None,
        train=types.SimpleNamespace(meta={}), eval=types.SimpleNamespace(meta={}),
    )  # fmt: skip
    issues = pipeline.data_issues(ctx, data)
    assert issues["prompts_skipped"] == {"train": 1, "eval": 0}
    assert issues["prompts_truncated"] == {"train": 0, "eval": 0}  # max_prompt_len 64 there
    with pytest.raises(C.ConfigError, match="data.long_prompts"):
        C.DataSpec(long_prompts="drop")

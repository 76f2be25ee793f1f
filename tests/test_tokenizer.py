"""Tokenizer: same ids, text and chat rendering as transformers; special tokens; errors."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors, trainers

from adaflash_jax.tokenizer import (
    CHATML_TEMPLATE,
    Tokenizer,
    TokenizerError,
    _byte_to_unicode,
    write_byte_tokenizer,
)

SPECIALS = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|mask|>", "[MASK]"]
LINES = [
    "the cat sat on the mat",
    "a dog ran to the park",
    "hello world how are you",
    "system user assistant you are helpful",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_word_level(path, *, tokenizer_config, generation_config=None):
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f)
    if generation_config is not None:
        with open(path / "generation_config.json", "w") as f:
            json.dump(generation_config, f)
    return tok


@pytest.fixture(scope="module")
def word_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("word")
    _write_word_level(
        path,
        tokenizer_config={
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": "</s>",
            "pad_token": "</s>",
            "chat_template": TEMPLATE,
        },
    )
    return path


def test_matches_transformers(word_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(word_dir))
    ours = Tokenizer(word_dir)
    text = "the cat ran to the zebra park"
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text)[0] == ours.bos_token_id == hf.bos_token_id
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    chats = [
        [{"role": "user", "content": "hello world"}],
        [
            {"role": "system", "content": "you are helpful"},
            {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "the cat sat"},
        ],
    ]
    for messages in chats:
        for gen_prompt in (True, False):
            want = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == want
    rendered = ours.apply_chat_template(chats[0])
    assert rendered.startswith("<s><|im_start|>user\nhello world<|im_end|>\n")
    assert ours.encode_chat(chats[0]) == ours.encode(rendered, add_special_tokens=False)
    assert ours.encode_chat(chats[0]).count(ours.bos_token_id) == 1  # no second BOS


def test_special_tokens_from_configs(word_dir, tmp_path):
    tok = Tokenizer(word_dir)
    eos = tok.token_to_id("</s>")
    assert tok.eos_token_ids == (eos,)  # from tokenizer_config when no generation_config
    assert tok.pad_token_id == eos
    assert tok.mask_token_id == tok.token_to_id("<|mask|>")

    # generation_config wins, as a list; an explicit mask_token entry wins over <|mask|>.
    path = tmp_path / "gen"
    _write_word_level(
        path,
        tokenizer_config={"eos_token": "</s>", "mask_token": "[MASK]"},
        generation_config={"eos_token_id": [4, 2]},
    )
    tok = Tokenizer(path)
    assert tok.eos_token_ids == (4, 2)
    assert tok.mask_token_id == tok.token_to_id("[MASK]") != tok.token_to_id("<|mask|>")
    assert tok.bos_token_id is None

    # generation_config with an int.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert Tokenizer(path).eos_token_ids == (3,)


def test_byte_tokenizer_round_trip(tmp_path):
    vocab = write_byte_tokenizer(tmp_path, chat_template=CHATML_TEMPLATE)
    tok = Tokenizer(tmp_path)
    assert vocab == tok.vocab_size == 260
    text = "héllo, wörld! 你好"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == (256,) and tok.mask_token_id == 259
    chat_ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat_ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(chat_ids) == "user\nhi\nassistant\n"  # specials skipped


def test_errors(word_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    tok = Tokenizer(word_dir)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{% for m in messages %}"
    with pytest.raises(TokenizerError, match="does not parse"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    # The sandbox refuses to reach Python internals from a template.
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|access"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_qwen35_sized_vocabulary_and_thinking_template_match_transformers(tmp_path):
    """A tokenizer the size of Qwen3.5's (special tokens above id 248,000, as its
    <|endoftext|> 248044 and <|im_end|> 248046) with a template that branches on thinking
    mode: our rendering and token ids equal transformers' for both settings."""
    transformers = pytest.importorskip("transformers")
    from doubles import THINKING_TEMPLATE

    vocab = {c: b for b, c in _byte_to_unicode().items()}
    vocab.update({f"<|filler_{i}|>": i for i in range(256, 248044)})
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config["chat_template"] = THINKING_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.token_to_id(ours.eos_token) == hf.eos_token_id == 248046
    messages = [{"role": "user", "content": "Write a haiku"}]
    for thinking in (False, True):
        want = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert ours.apply_chat_template(messages, enable_thinking=thinking) == want
        ids = ours.encode_chat(messages, enable_thinking=thinking)
        assert ids == hf(want, add_special_tokens=False)["input_ids"]
        assert (248047 in ids) == (not thinking)  # <think> only when thinking is off

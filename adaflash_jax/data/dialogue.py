"""The dialogue domain: user/assistant exchanges rendered with the project's chat template.

Exchanges are built from the other domains' material (questions about stdlib functions and
documentation topics, math problems), so the domain needs no extra source. The template is
stored in tokenizer_config.json as `chat_template`; `render_chat` applies the same jinja
text here, so training documents are exactly what `tokenizer.apply_chat_template` produces.

Format: every message is `<|role|>\n` + content, closed by `\n` for user/system turns and by
the EOS token for assistant turns (generation stops at EOS in plain and chat use alike).
"""

from __future__ import annotations

import functools

import jinja2

from adaflash_jax.data.math_gen import math_problem
from adaflash_jax.data.sources import RawDoc, stable_hash

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' }}{{ '\n' }}{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- else -%}{{ '\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{{ '\n' }}{%- endif -%}"
)


def _raise(message: str):
    raise ValueError(message)


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(keep_trailing_newline=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return _template().render(
        messages=messages, add_generation_prompt=add_generation_prompt, eos_token=EOS_TOKEN
    )


def _chat_doc(key: str, messages: list[dict[str, str]]) -> RawDoc:
    """Document = whole conversation; prompt = everything before the first assistant reply."""
    first_user = messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]
    return RawDoc(
        key=key,
        text=render_chat(messages),
        prompt=render_chat(first_user, add_generation_prompt=True),
    )


def code_dialogue(doc: RawDoc) -> RawDoc:
    """A question about one stdlib function, answered from its docstring or its source."""
    if stable_hash("code-dialogue", doc.key) % 2:
        question = f"What does `{doc.title}` from the Python standard library do?"
        answer = f"`{doc.title}`: {doc.summary}"
    else:
        question = f"Show me how `{doc.title}` is implemented in the Python standard library."
        answer = f"Here is its source:\n```python\n{doc.text.rstrip()}\n```"
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return _chat_doc(f"dialogue:{doc.key}", messages)


def prose_dialogue(doc: RawDoc) -> RawDoc:
    question = f"Explain {doc.title} in Python." if doc.title else "Explain this."
    answer = doc.text.strip()
    if len(answer) > 1200:
        answer = answer[:1200].rsplit("\n\n", 1)[0]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if stable_hash("prose-dialogue", doc.key) % 3 == 0:
        messages.insert(0, {"role": "system", "content": "You are a concise Python expert."})
    return _chat_doc(f"dialogue:{doc.key}", messages)


def math_dialogue(seed: int, index: int) -> RawDoc:
    """A fresh math problem (its own stream, never in the math domain) solved in chat."""
    statement, steps, answer = math_problem(seed, index)
    solution = " ".join(steps) + f" So the answer is {answer}."
    messages = [
        {"role": "user", "content": statement},
        {"role": "assistant", "content": solution},
    ]
    if index % 2:
        messages += [
            {"role": "user", "content": "Just the final answer, please."},
            {"role": "assistant", "content": answer},
        ]
    return _chat_doc(f"dialogue:math:{seed}:{index}", messages)

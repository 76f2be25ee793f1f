"""Seeded generator of small math problems with step-by-step worked solutions.

Four kinds: arithmetic with order of operations, linear equations, word problems and
fraction arithmetic. Problem `i` depends only on (seed, i), so any slice of the stream is
reproducible on its own and keys (`math:<seed>:<i>`) are stable.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

from adaflash_jax.data.sources import RawDoc

_NAMES = ("Ada", "Bruno", "Chen", "Dara", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas")
_ITEMS = ("apples", "pencils", "stamps", "marbles", "cookies", "books", "shells", "cards")


def _paren(n: int) -> str:
    return f"({n})" if n < 0 else str(n)


def _arithmetic(rng: random.Random) -> tuple[str, list[str], str]:
    a, b, c, d = (rng.randint(2, 30) for _ in range(4))
    op1, op2 = rng.choice("+-"), rng.choice("+-")
    product = b * c
    statement = f"Compute {a} {op1} {b} × {c} {op2} {d}."
    first = a + product if op1 == "+" else a - product
    result = first + d if op2 == "+" else first - d
    steps = [
        f"Multiplication comes before addition and subtraction: {b} × {c} = {product}.",
        f"Now work from left to right: {a} {op1} {product} = {first}.",
        f"Then {first} {op2} {d} = {result}.",
    ]
    return statement, steps, str(result)


def _linear(rng: random.Random) -> tuple[str, list[str], str]:
    a = rng.randint(2, 12)
    x = rng.randint(-15, 20)
    b = rng.randint(-30, 30)
    c = a * x + b
    sign = "+" if b >= 0 else "-"
    statement = f"Solve for x: {a}x {sign} {abs(b)} = {c}."
    move, prep, inverse = ("Subtract", "from", "-") if b >= 0 else ("Add", "to", "+")
    steps = [
        f"{move} {abs(b)} {prep} both sides: {a}x = {c} {inverse} {abs(b)} = {c - b}.",
        f"Divide both sides by {a}: x = {c - b} / {a} = {x}.",
        f"Check: {a} × {_paren(x)} {sign} {abs(b)} = {a * x} {sign} {abs(b)} = {c}. Correct.",
    ]
    return statement, steps, f"x = {x}"


def _word(rng: random.Random) -> tuple[str, list[str], str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    start = rng.randint(5, 40)
    packs, per_pack = rng.randint(2, 6), rng.randint(3, 12)
    gives = rng.randint(2, start + packs * per_pack - 1)
    bought = packs * per_pack
    total = start + bought
    left = total - gives
    statement = (
        f"{name} has {start} {item}. {name} buys {packs} packs with {per_pack} {item} in each "
        f"pack, then gives {gives} {item} to a friend. How many {item} does {name} have now?"
    )
    steps = [
        f"The packs hold {packs} × {per_pack} = {bought} {item}.",
        f"After buying, {name} has {start} + {bought} = {total} {item}.",
        f"After giving {gives} away, {name} has {total} - {gives} = {left} {item}.",
    ]
    return statement, steps, f"{left} {item}"


def _fraction(rng: random.Random) -> tuple[str, list[str], str]:
    b, d = rng.randint(2, 12), rng.randint(2, 12)
    a, c = rng.randint(1, 2 * b - 1), rng.randint(1, 2 * d - 1)
    op = rng.choice("+-×")
    p, q = Fraction(a, b), Fraction(c, d)
    statement = f"Compute {a}/{b} {op} {c}/{d} and simplify."
    steps = []
    if op == "×":
        num, den = a * c, b * d
        steps.append(
            f"Multiply the numerators and the denominators: "
            f"({a} × {c}) / ({b} × {d}) = {num}/{den}."
        )
        result = p * q
    else:
        den = b * d // math.gcd(b, d)
        a2, c2 = a * (den // b), c * (den // d)
        num = a2 + c2 if op == "+" else a2 - c2
        word = "Add" if op == "+" else "Subtract"
        steps.append(f"The least common denominator of {b} and {d} is {den}.")
        steps.append(f"Rewrite both fractions: {a}/{b} = {a2}/{den} and {c}/{d} = {c2}/{den}.")
        steps.append(f"{word} the numerators: {a2} {op} {c2} = {num}, which gives {num}/{den}.")
        result = p + q if op == "+" else p - q
    g = math.gcd(num, den)
    if g > 1:
        steps.append(
            f"Divide the numerator and the denominator by their greatest common divisor "
            f"{g}: {result}."
        )
    else:
        steps.append(f"{num}/{den} is already in lowest terms.")
    return statement, steps, str(result)


_KINDS = (_arithmetic, _linear, _word, _fraction)


def math_problem(seed: int, index: int) -> tuple[str, list[str], str]:
    """(statement, solution steps, final answer) of problem `index` of stream `seed`."""
    rng = random.Random(f"math-{seed}-{index}")
    return _KINDS[index % len(_KINDS)](rng)


def render_problem(statement: str, steps: list[str], answer: str) -> tuple[str, str]:
    """(prompt, full text) in the corpus's plain-text math format."""
    prompt = f"Problem: {statement}\nSolution:\n"
    body = "".join(f"Step {i}: {s}\n" for i, s in enumerate(steps, 1))
    return prompt, f"{prompt}{body}Answer: {answer}"


def math_documents(seed: int, count: int) -> list[RawDoc]:
    docs = []
    for i in range(count):
        statement, steps, answer = math_problem(seed, i)
        prompt, text = render_problem(statement, steps, answer)
        docs.append(
            RawDoc(
                key=f"math:{seed}:{i}", text=text, prompt=prompt, title=statement, summary=answer
            )
        )
    return docs

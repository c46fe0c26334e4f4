"""Synthetic tool-integrated-reasoning (TIR) traces: problem -> python block -> real output -> boxed answer.

The embedded TIR source is SmolLM2 fine-tuned on these traces, calibration text for quantization is
drawn from them, and the quality gate uses held-out problems. The code in each trace is executed
for real (in a child interpreter) so the output block is what python prints, not a guess. The code
tags come from the recipe, i.e. the same tags the server parses.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from aimo_spec.chat import output_block
from aimo_spec.recipe import CodeTags

VERSION = 1  # bump when the traces or the fine-tune (tir_finetune.py) change for the same recipe


@dataclass(frozen=True)
class Problem:
    text: str
    code: str


def _products(r: random.Random) -> Problem:
    a, b, c = r.randint(3, 40), r.randint(3, 60), r.randint(2, 24)
    item, box = r.choice([("bottles", "crates"), ("books", "cartons"), ("eggs", "trays"), ("pencils", "packs")])
    return Problem(
        f"A warehouse has {a} shelves. Each shelf holds {b} {box} and each of the {box} holds {c} {item}. "
        f"How many {item} are in the warehouse?",
        f"shelves = {a}\n{box} = {b}\n{item} = {c}\nprint(shelves * {box} * {item})",
    )


def _range_sum(r: random.Random) -> Problem:
    a = r.randint(1, 200)
    b = a + r.randint(10, 900)
    return Problem(f"What is the sum of all integers from {a} to {b}, inclusive?", f"print(sum(range({a}, {b} + 1)))")


def _power_mod(r: random.Random) -> Problem:
    a, b, m = r.randint(2, 99), r.randint(10, 500), r.randint(7, 1000)
    return Problem(f"What is the remainder when {a}^{{{b}}} is divided by {m}?", f"print(pow({a}, {b}, {m}))")


def _multiples(r: random.Random) -> Problem:
    n, a, b = r.randint(100, 5000), r.randint(2, 13), r.randint(2, 13)
    return Problem(
        f"How many integers from 1 to {n} are divisible by {a} or by {b}?",
        f"count = 0\nfor k in range(1, {n} + 1):\n"
        f"    if k % {a} == 0 or k % {b} == 0:\n        count += 1\nprint(count)",
    )


def _lcm(r: random.Random) -> Problem:
    a, b, c = r.randint(2, 60), r.randint(2, 60), r.randint(2, 60)
    return Problem(f"What is the least common multiple of {a}, {b} and {c}?",
                   f"import math\nprint(math.lcm({a}, {b}, {c}))")


def _digit_sum(r: random.Random) -> Problem:
    a, b = r.randint(100, 99999), r.randint(100, 9999)
    return Problem(
        f"What is the sum of the digits of {a} times {b}?",
        f"n = {a} * {b}\nprint(sum(int(d) for d in str(n)))",
    )


def _committee(r: random.Random) -> Problem:
    n = r.randint(6, 30)
    k = r.randint(2, min(8, n - 1))
    return Problem(
        f"In how many ways can a committee of {k} people be chosen from a club of {n} people?",
        f"import math\nprint(math.comb({n}, {k}))",
    )


def _primes(r: random.Random) -> Problem:
    n = r.randint(50, 3000)
    return Problem(
        f"How many prime numbers are less than {n}?",
        f"def is_prime(k):\n    return k > 1 and all(k % d for d in range(2, int(k ** 0.5) + 1))\n"
        f"print(sum(1 for k in range({n}) if is_prime(k)))",
    )


def _change(r: random.Random) -> Problem:
    a, p, b, q = r.randint(2, 12), r.randint(2, 15), r.randint(2, 12), r.randint(1, 9)
    bill = (a * p + b * q) // 50 * 50 + 50 * r.randint(1, 3)
    return Problem(
        f"Tom buys {a} notebooks at {p} dollars each and {b} pens at {q} dollars each. "
        f"He pays with {bill} dollars. How many dollars of change does he get?",
        f"cost = {a} * {p} + {b} * {q}\nprint({bill} - cost)",
    )


GENERATORS: tuple[Callable[[random.Random], Problem], ...] = (
    _products, _range_sum, _power_mod, _multiples, _lcm, _digit_sum, _committee, _primes, _change,
)


def make_problems(n: int, seed: int) -> list[Problem]:
    """`n` problems, deterministic in `seed`; templates are cycled so every kind appears."""
    r = random.Random(seed)
    return [GENERATORS[i % len(GENERATORS)](r) for i in range(n)]


_RUNNER = r"""
import contextlib, io, json, sys
outs = []
for code in json.load(sys.stdin):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "<trace>", "exec"), {"__name__": "__main__"})
    outs.append(buf.getvalue())
json.dump(outs, sys.stdout)
"""


def run_code(codes: list[str], timeout: float = 120.0) -> list[str]:
    """Execute the generated (trusted, project-written) snippets in a child interpreter."""
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _RUNNER], input=json.dumps(codes), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"trace code failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def format_trace(problem: Problem, output: str, tags: CodeTags) -> str:
    """The assistant turn, byte for byte what the server's TIR client expects to see."""
    answer = output.strip()
    return (
        "I will compute this with Python.\n"
        f"{tags.code_start}{problem.code}\n{tags.code_end}"
        f"{output_block(tags, output)}"
        f"The answer is $\\boxed{{{answer}}}$."
    )


@dataclass(frozen=True)
class Trace:
    problem: str
    reply: str
    answer: str


def make_traces(n: int, seed: int, tags: CodeTags) -> list[Trace]:
    problems = make_problems(n, seed)
    outputs = run_code([p.code for p in problems])
    return [Trace(p.text, format_trace(p, o, tags), o.strip()) for p, o in zip(problems, outputs)]

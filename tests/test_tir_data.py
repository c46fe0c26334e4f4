"""Synthetic TIR traces: deterministic, real code output, the recipe's code tags."""

from __future__ import annotations

import re

from aimo_spec.recipe import CodeTags
from trtbuild.tir_data import GENERATORS, make_problems, make_traces, run_code


def test_deterministic_and_covers_every_template():
    a, b = make_problems(27, seed=5), make_problems(27, seed=5)
    assert a == b
    assert make_problems(27, seed=6) != a
    assert len({p.text.split()[0:3].__str__() for p in a}) >= len(GENERATORS) - 2


def test_output_block_is_what_python_prints():
    traces = make_traces(18, seed=3, tags=CodeTags())
    for t in traces:
        code = t.reply.split("```python\n", 1)[1].split("\n```\n", 1)[0]
        assert run_code([code])[0].strip() == t.answer
        assert f"```output\n{t.answer}\n```\n" in t.reply
        assert t.reply.endswith(f"\\boxed{{{t.answer}}}$.")
    remainders = [t for t in traces if t.problem.startswith("What is the remainder")]
    assert remainders
    for t in remainders:  # independent recomputation of the answer from the problem text
        a, b, m = map(int, re.fullmatch(r"What is the remainder when (\d+)\^\{(\d+)\} is divided by (\d+)\?",
                                        t.problem).groups())
        assert t.answer == str(pow(a, b, m))


def test_custom_code_tags_are_used():
    tags = CodeTags(code_start="<tool_call>\n", code_end="</tool_call>\n", output_start="```output\n",
                    output_end="```\n")
    t = make_traces(1, seed=0, tags=tags)[0]
    assert "<tool_call>\n" in t.reply and "</tool_call>\n```output\n" in t.reply
    assert "```python" not in t.reply

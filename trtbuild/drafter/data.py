"""Drafter training data: the target model's own TIR generations, made by the project's runtime.

The drafter must learn what the *served* model writes (the merged, quantized weights), in the
serving format: the chat template, the recipe's code tags, code really run in the sandbox and its
output block appended, with the serving sampling parameters. Each sample keeps its token history as
segments (model tokens vs appended output blocks): the head is trained and measured only on the
model's own tokens, while output blocks still shape the context.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aimo_spec.recipe import Recipe
from trtbuild.tir_data import make_problems

TRAIN_SEED_OFFSET = 50_000  # problem seeds apart from the TIR fine-tune, calibration and quality sets
HELDOUT_SEED_OFFSET = 60_000


@dataclass
class Sequence:
    """One sample: prompt + history; `generated[i]` says whether token i was written by the model."""

    ids: list[int]
    generated: list[bool]
    problem: str
    finish: str
    outputs: int = 0  # output blocks appended (code the model ran)

    @property
    def model_tokens(self) -> int:
        return sum(self.generated)


def problems(recipe: Recipe, heldout: bool) -> list[str]:
    t = recipe.drafter.train
    n, offset = (t.heldout_prompts, HELDOUT_SEED_OFFSET) if heldout else (t.prompts, TRAIN_SEED_OFFSET)
    return [p.text for p in make_problems(n, t.seed + offset)]


async def _generate(engine: Any, sandbox: Any, recipe: Recipe, texts: list[str], samples: int) -> list[Sequence]:
    from server.assembly import tir_client

    s, t = recipe.serving, recipe.drafter.train
    client = tir_client(s, engine, sandbox, max_tokens=t.max_tokens, record_tokens=True)

    async def one(i: int, text: str, k: int) -> Sequence:
        prompt = engine.tokenize(engine.chat_prompt(text, s.system_prompt))
        trace = await client.run(prompt, k, seed=t.seed * 100_003 + i * samples + k)
        ids, gen = list(prompt), [False] * len(prompt)
        for seg, by_model in trace.segments:
            ids += seg
            gen += [by_model] * len(seg)
        return Sequence(ids, gen, text, trace.finish, sum(1 for _, by_model in trace.segments if not by_model))

    jobs = [one(i, text, k) for i, text in enumerate(texts) for k in range(samples)]
    return list(await asyncio.gather(*jobs))


def generate(recipe: Recipe, target_dir: Path, train: bool = True,
             log: Any = print) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held-out) samples of the target, with the real sandbox; training is empty when
    `train` is false (a given drafter is only measured)."""
    from server.assembly import sandbox_for
    from server.embedded.engine import EmbeddedEngine

    b = recipe.build
    engine = EmbeddedEngine.from_dir(target_dir, max_batch_size=b.max_batch_size, max_seq_len=b.max_seq_len,
                                     max_input_len=b.max_input_len)
    out: list[list[Sequence]] = []
    try:
        with sandbox_for(recipe.serving.tool) as pool:
            for heldout in (False, True):
                if not heldout and not train:
                    out.append([])
                    continue
                samples = 1 if heldout else recipe.drafter.train.samples_per_prompt
                seqs = asyncio.run(_generate(engine, pool, recipe, problems(recipe, heldout), samples))
                log(f"{'held-out' if heldout else 'training'} generations: {len(seqs)} samples, "
                    f"{sum(s.model_tokens for s in seqs)} model tokens, "
                    f"{sum(s.outputs for s in seqs)} code outputs")
                out.append(seqs)
    finally:
        engine.shutdown()
    return out[0], out[1]

"""The price of the FP8 KV cache (`serving.kv_cache_dtype: fp8`) for the weights a build serves.

The KV dtype is a serving choice (no rebuild to switch it), but it is lossy like a quantized format,
so the embedded build prices it once for the weights it packs, with the same gate as every lossy
stage (trtbuild/quality.py): greedy replies on the quality prompts and teacher-forced KL and token
agreement, here through the embedded runtime's own slot runner with a model-dtype cache (the
reference) and with the FP8 cache (the candidate). `make report` prints it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from aimo_spec.recipe import Recipe
from trtbuild.quality import Price, Replies, price_of, quality_prompts

# prompts replied to at once: a decode step of 8 rows costs little more than one of a single row where
# the step is bound by reading the weights (a GPU, or a CPU's small-batch matmuls); trtbuild.quality
# batches its greedy replies by the same number
REPLY_SLOTS = 8


@torch.inference_mode()
def runner_replies(runner: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                   slots: int = 1) -> Replies:
    """Greedy replies through a runner's slots 0..slots-1, `slots` prompts at a time (prefill each,
    then one decode step a token for all of them), each ending at EOS. A row that has ended keeps
    rewriting its last token in its own cell, so the others' steps stay one batched call."""
    eos = tokenizer.eos_token_id
    tokens: list[list[int]] = []
    for start in range(0, len(prompts), slots):
        chunk = prompts[start: start + slots]
        logits = torch.stack([runner.prefill(j, p, 0).reshape(-1) for j, p in enumerate(chunk)])
        replies: list[list[int]] = [[] for _ in chunk]
        live = [True] * len(chunk)
        while True:
            picked = logits.argmax(-1).tolist()
            for j, t in enumerate(picked):
                if live[j]:
                    replies[j].append(t)
                    live[j] = t != eos and len(replies[j]) < max_new_tokens
            if not any(live):
                break
            logits = runner.decode([r[-1] for r in replies], [len(p) + len(r) - 1 for p, r in zip(chunk, replies)])
        tokens += replies
    return Replies(prompts, tokens, [tokenizer.decode(t, skip_special_tokens=True) for t in tokens])


def runner_logprobs(runner: Any, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log p(. | prefix) at each reply position, teacher-forced through the runner's cache."""
    logits = runner.score(0, prompt + reply)[len(prompt) - 1: len(prompt) + len(reply) - 1]
    return logits.float().log_softmax(-1).cpu()


def kv_cache_price(model_dir: Path, recipe: Recipe) -> Price:
    """FP8 KV cache against the model-dtype cache, on the served weights in `model_dir`, on the build
    stages' device (`stage_device`: TRTBUILD_DEVICE)."""
    from aimo_spec.chat import load_tokenizer
    from server.embedded.loader import load_model, stage_device
    from server.embedded.runner import SlotRunner

    model = load_model(model_dir, device=stage_device())
    tokenizer = load_tokenizer(model_dir)
    prompts = quality_prompts(recipe, tokenizer)
    q = recipe.quality
    length = max(map(len, prompts)) + q.max_new_tokens + 1
    slots = min(len(prompts), REPLY_SLOTS)
    exact = SlotRunner(model, slots, length, initial_capacity=length)
    fp8 = SlotRunner(model, slots, length, initial_capacity=length, kv_cache_dtype="fp8")
    ref = runner_replies(exact, tokenizer, prompts, q.max_new_tokens, slots)
    cand = runner_replies(fp8, tokenizer, prompts, q.max_new_tokens, slots)
    return price_of(lambda p, r: runner_logprobs(exact, p, r), lambda p, r: runner_logprobs(fp8, p, r), ref, cand,
                    recipe.serving.code_tags)

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


@torch.inference_mode()
def runner_replies(runner: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> Replies:
    """Greedy replies through a runner's slot 0 (prefill, then one decode step a token), ending at EOS."""
    eos = tokenizer.eos_token_id
    tokens: list[list[int]] = []
    for prompt in prompts:
        logits, reply = runner.prefill(0, prompt, 0), []
        while len(reply) < max_new_tokens:
            t = int(logits.argmax(-1))
            reply.append(t)
            if t == eos:
                break
            logits = runner.decode([t], [len(prompt) + len(reply) - 1])[0]
        tokens.append(reply)
    return Replies(prompts, tokens, [tokenizer.decode(t, skip_special_tokens=True) for t in tokens])


def runner_logprobs(runner: Any, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log p(. | prefix) at each reply position, teacher-forced through the runner's cache."""
    logits = runner.score(0, prompt + reply)[len(prompt) - 1: len(prompt) + len(reply) - 1]
    return logits.float().log_softmax(-1).cpu()


def kv_cache_price(model_dir: Path, recipe: Recipe, device: str = "auto") -> Price:
    """FP8 KV cache against the model-dtype cache, on the served weights in `model_dir`."""
    from aimo_spec.chat import load_tokenizer
    from server.embedded.loader import load_model
    from server.embedded.runner import SlotRunner
    from server.embedded.settings import resolve_device

    model = load_model(model_dir, device=resolve_device(device))
    tokenizer = load_tokenizer(model_dir)
    prompts = quality_prompts(recipe, tokenizer)
    q = recipe.quality
    length = max(map(len, prompts)) + q.max_new_tokens + 1
    exact = SlotRunner(model, 1, length, initial_capacity=length)
    fp8 = SlotRunner(model, 1, length, initial_capacity=length, kv_cache_dtype="fp8")
    ref = runner_replies(exact, tokenizer, prompts, q.max_new_tokens)
    cand = runner_replies(fp8, tokenizer, prompts, q.max_new_tokens)
    return price_of(lambda p, r: runner_logprobs(exact, p, r), lambda p, r: runner_logprobs(fp8, p, r), ref, cand,
                    recipe.serving.code_tags)

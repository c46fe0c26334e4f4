"""The price of a lossy stage, measured on recorded replies.

The reference model (the stage's input) answers a fixed prompt set greedily; those replies are
recorded. The candidate (the stage's output) is then teacher-forced on the same tokens, giving the
KL divergence of next-token distributions and greedy-token agreement at every reply position;
both models also reply on their own, giving mean reply length and code calls per reply (thinking
length is a vital sign: a >10% move is suspect).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from aimo_spec.chat import encode, render_prompt
from aimo_spec.recipe import CodeTags, QualitySpec, Recipe
from trtbuild.tir_data import make_problems


@dataclass
class Replies:
    """Greedy replies of one model on the prompt set (token ids, without the prompt)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    texts: list[str]

    def mean_length(self) -> float:
        return statistics.fmean(len(t) for t in self.tokens)

    def code_calls(self, tags: CodeTags) -> float:
        return statistics.fmean(t.count(tags.code_start.strip()) for t in self.texts)


def quality_prompts(recipe: Recipe, tokenizer: Any) -> list[list[int]]:
    """Held-out problems (a seed disjoint from training) in the serving chat format."""
    problems = make_problems(recipe.quality.prompts, recipe.quality.seed)
    return [encode(tokenizer, render_prompt(tokenizer, p.text, recipe.serving.system_prompt)) for p in problems]


@torch.no_grad()
def record_replies(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                   batch: int = 8) -> Replies:
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    tokens: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long, device=model.device)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):  # left padding for generation
            ids[j, width - len(p) :] = torch.tensor(p, device=model.device)
            mask[j, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=pad, eos_token_id=eos,
        )
        for row in out[:, width:].tolist():
            reply = []
            for t in row:
                reply.append(t)
                if t == eos:
                    break
            tokens.append(reply)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return Replies(prompts, tokens, texts)


@torch.no_grad()
def _reply_logprobs(model: Any, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log p(. | prefix) at each reply position: [len(reply), vocab] in fp32."""
    ids = torch.tensor([prompt + reply], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(reply) - 1]
    return logits.float().log_softmax(-1)


@dataclass
class Price:
    kl_mean: float
    kl_p95: float
    token_agreement: float
    positions: int
    reply_len_ref: float
    reply_len: float
    reply_len_ratio: float
    code_calls_ref: float
    code_calls: float

    def summary(self) -> str:
        return (f"KL {self.kl_mean:.4f} (p95 {self.kl_p95:.4f}), agreement {self.token_agreement:.1%}, "
                f"reply length {self.reply_len:.1f} vs {self.reply_len_ref:.1f} ({self.reply_len_ratio:.2f}x), "
                f"code calls {self.code_calls:.2f} vs {self.code_calls_ref:.2f}")

    def verdict(self, spec: QualitySpec) -> list[str]:
        """Reasons this price is suspect (empty when within the recipe's thresholds)."""
        out = []
        if self.kl_mean > spec.max_kl:
            out.append(f"KL {self.kl_mean:.4f} > {spec.max_kl}")
        if self.token_agreement < spec.min_agreement:
            out.append(f"agreement {self.token_agreement:.1%} < {spec.min_agreement:.0%}")
        if abs(self.reply_len_ratio - 1.0) > spec.max_length_change:
            out.append(f"reply length moved {self.reply_len_ratio - 1:+.0%} (limit {spec.max_length_change:.0%})")
        return out

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def price(ref_model: Any, cand_model: Any, tokenizer: Any, ref: Replies, max_new_tokens: int, tags: CodeTags,
          cand: Replies | None = None) -> Price:
    """Compare `cand_model` with the reference whose recorded replies are `ref`."""
    cand = cand or record_replies(cand_model, tokenizer, ref.prompts, max_new_tokens)
    return price_of(lambda p, r: _reply_logprobs(ref_model, p, r), lambda p, r: _reply_logprobs(cand_model, p, r),
                    ref, cand, tags)


LogProbs = Callable[[list[int], list[int]], torch.Tensor]  # (prompt, reply) -> [len(reply), vocab] log p


def price_of(ref_logprobs: LogProbs, cand_logprobs: LogProbs, ref: Replies, cand: Replies, tags: CodeTags) -> Price:
    """The price of a candidate against a reference, each given as teacher-forced log-probabilities
    (models, or a runtime option such as the FP8 KV cache) and its own greedy replies."""
    kls: list[float] = []
    agree = 0
    for prompt, reply in zip(ref.prompts, ref.tokens):
        if not reply:
            continue
        lp_ref = ref_logprobs(prompt, reply)
        lp_cand = cand_logprobs(prompt, reply).to(lp_ref.device)  # a runtime's may come from elsewhere
        kls += (lp_ref.exp() * (lp_ref - lp_cand)).sum(-1).clamp_min(0).tolist()
        agree += int((lp_ref.argmax(-1) == lp_cand.argmax(-1)).sum())
    kls_sorted = sorted(kls)
    n = max(1, len(kls))
    return Price(
        kl_mean=statistics.fmean(kls) if kls else 0.0,
        kl_p95=kls_sorted[min(len(kls_sorted) - 1, int(0.95 * len(kls_sorted)))] if kls else 0.0,
        token_agreement=agree / n,
        positions=len(kls),
        reply_len_ref=ref.mean_length(),
        reply_len=cand.mean_length(),
        reply_len_ratio=cand.mean_length() / max(1e-9, ref.mean_length()),
        code_calls_ref=ref.code_calls(tags),
        code_calls=cand.code_calls(tags),
    )

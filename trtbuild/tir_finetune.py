"""LoRA fine-tune of a base checkpoint on synthetic TIR traces -> a merged HF checkpoint.

Runs on CPU in minutes for the embedded SmolLM2 (loss only on the assistant's tokens, and the
vocabulary head applied only at those positions, which is most of a small model's cost). Training
runs in float32 on the CPU: without AVX-512 BF16/AMX, PyTorch's bf16 matmuls are emulated and a step
takes over 10x longer (measured on the 2-core AVX2 CI machine: >100 s vs 8 s per step). On CUDA it
trains in bf16. The merged checkpoint is saved in bf16 either way.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from aimo_spec.chat import encode, load_tokenizer, render_prompt
from aimo_spec.recipe import CodeTags, TIRFinetuneSource
from server.embedded.loader import load_model, use_all_cores
from server.embedded.settings import resolve_device
from trtbuild.manifest import log
from trtbuild.tir_data import Trace, make_traces

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HELDOUT_SEED_OFFSET = 10_000


def _examples(tok: Any, traces: list[Trace], max_length: int, system_prompt: str | None) -> list[tuple[list[int], int]]:
    """(ids, prompt_len) per trace; the reply ends with EOS so the model learns to stop."""
    out = []
    for t in traces:
        prompt = encode(tok, render_prompt(tok, t.problem, system_prompt))
        reply = encode(tok, t.reply) + [tok.eos_token_id]
        ids = (prompt + reply)[:max_length]
        if len(ids) > len(prompt):
            out.append((ids, len(prompt)))
    return out


def _batch_loss(model: Any, batch: list[tuple[list[int], int]], pad_id: int) -> torch.Tensor:
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, (ids, plen) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        target[i, plen - 1 : len(ids) - 1] = True  # position t predicts token t+1
    input_ids, mask, target = input_ids.to(device), mask.to(device), target.to(device)
    core = model.get_base_model()
    hidden = core.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    logits = core.lm_head(hidden[target]).float()
    labels = input_ids[:, 1:][target[:, :-1]]
    return torch.nn.functional.cross_entropy(logits, labels)


def finetune(spec: TIRFinetuneSource, base_dir: Path, out_dir: Path, tags: CodeTags,
             system_prompt: str | None) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    use_all_cores()
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    t0 = time.time()
    traces = make_traces(spec.traces, spec.seed, tags)
    heldout = make_traces(32, spec.seed + HELDOUT_SEED_OFFSET, tags)
    tok = load_tokenizer(base_dir)
    train = _examples(tok, traces, spec.max_length, system_prompt)
    held = _examples(tok, heldout, spec.max_length, system_prompt)
    log("sources", f"tir: {len(train)} traces ({sum(len(i) for i, _ in train)} tokens) in {time.time() - t0:.1f}s")

    device = resolve_device("auto")
    model = load_model(base_dir, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    model = get_peft_model(
        model,
        LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0, target_modules=TARGET_MODULES),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    warmup = max(1, spec.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / spec.steps)))
    )

    def heldout_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [_batch_loss(model, held[i : i + 8], tok.pad_token_id).item() for i in range(0, len(held), 8)]
        model.train()
        return sum(losses) / len(losses)

    before = heldout_loss()
    model.train()
    curve = []
    t_train = time.time()
    order: list[int] = []
    for step in range(spec.steps):
        if len(order) < spec.batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch = [train[order.pop()] for _ in range(spec.batch_size)]
        loss = _batch_loss(model, batch, tok.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        curve.append(round(loss.item(), 4))
        if (step + 1) % 10 == 0 or step + 1 == spec.steps:
            el = time.time() - t_train
            eta = el / (step + 1) * (spec.steps - step - 1)
            log("sources", f"tir: step {step + 1}/{spec.steps} loss {sum(curve[-10:]) / len(curve[-10:]):.3f} "
                f"({el:.0f}s, eta {eta:.0f}s)")
    after = heldout_loss()
    log("sources", f"tir: held-out loss {before:.3f} -> {after:.3f}")
    merged = model.merge_and_unload()
    merged.to("cpu", torch.bfloat16).save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return {
        "train_traces": len(train),
        "train_seconds": round(time.time() - t_train, 1),
        "train_device": str(device),
        "loss_curve": curve,
        "heldout_loss_before": round(before, 4),
        "heldout_loss_after": round(after, 4),
        "example_trace": traces[0].reply,
    }

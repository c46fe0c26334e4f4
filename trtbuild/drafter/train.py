"""Train the ReDrafter head on the frozen target's hidden states, and export it for TensorRT-LLM.

For every position t whose next K+1 tokens x1..x(K+1) follow it in a sample, the example is
(h_t, x1..xK) -> targets x2..x(K+1); step k's loss counts only where its target is a model token
(not an appended output block, which the engine prefills and never drafts). Loss = the sum over
steps of the cross entropies; the log reports top-1 accuracy per step on held-out positions.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional as F

from aimo_spec.recipe import DrafterTrainSpec
from server.embedded.redrafter import DrafterConfig, ReDrafter
from server.embedded.settings import resolve_device
from trtbuild.drafter.data import Sequence


@dataclass
class Examples:
    context: torch.Tensor  # [N, H] float32: h_t
    tokens: torch.Tensor  # [N, K+1] long: x1..x(K+1)
    mask: torch.Tensor  # [N, K] bool: target x(k+2) is a model token


def device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def hidden_states(model: Any, ids: list[int]) -> torch.Tensor:
    """The target's last hidden state (final norm applied: the input of its vocabulary head) per position,
    in the model's dtype, on the model's device."""
    return model.model(input_ids=torch.tensor([ids], device=device_of(model))).last_hidden_state[0]


def examples(model: Any, seqs: list[Sequence], k: int) -> Examples:
    ctx, toks, masks = [], [], []
    for s in seqs:
        h = hidden_states(model, s.ids).float().cpu()
        gen = torch.tensor(s.generated)
        ids = torch.tensor(s.ids)
        n = len(s.ids)
        # positions t with x1 = ids[t+1] a model token and K+1 tokens available after t
        for t in range(n - k - 1):
            if not gen[t + 1]:
                continue
            ctx.append(h[t])
            toks.append(ids[t + 1:t + k + 2])
            masks.append(gen[t + 2:t + k + 2])
    if not ctx:
        raise ValueError("drafter: the target generated no usable tokens (check the engine and prompts)")
    return Examples(torch.stack(ctx), torch.stack(toks), torch.stack(masks))


def step_loss(drafter: ReDrafter, embed: Any, batch: Examples) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed masked cross entropy, per-step top-1 hits [K] and counts [K] stacked as [2, K])."""
    k = batch.mask.shape[1]
    emb = embed(batch.tokens[:, :k]).float()
    logits = drafter(batch.context, emb)  # [B, K, V]
    target = batch.tokens[:, 1:k + 1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(target.shape)
    m = batch.mask.float()
    loss = (ce * m).sum(0) / m.sum(0).clamp_min(1.0)
    hits = ((logits.argmax(-1) == target).float() * m).sum(0)
    return loss.sum(), torch.stack([hits, m.sum(0)])


def _subset(ex: Examples, idx: torch.Tensor, device: Any = None) -> Examples:
    return Examples(ex.context[idx].to(device), ex.tokens[idx].to(device), ex.mask[idx].to(device))


def accuracy(drafter: ReDrafter, embed: Any, ex: Examples, batch: int = 256) -> list[float]:
    dev = next(drafter.parameters()).device
    total = torch.zeros(2, ex.mask.shape[1], device=dev)
    with torch.no_grad():
        for i in range(0, len(ex.context), batch):
            total += step_loss(drafter, embed, _subset(ex, torch.arange(i, min(i + batch, len(ex.context))), dev))[1]
    return [round(float(h / max(c, 1.0)), 4) for h, c in zip(total[0], total[1])]


def frozen_embedding(model: Any, device: Any) -> torch.nn.Embedding:
    """The target's token embedding as a frozen float32 copy next to the head (the head is trained in fp32)."""
    return torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().float().to(device),
                                              freeze=True)


def train(model: Any, train_seqs: list[Sequence], heldout_seqs: list[Sequence], spec: DrafterTrainSpec,
          log: Callable[[str], None] = print, device: Any = None) -> tuple[ReDrafter, dict[str, Any]]:
    """Train on `device` (default: CUDA when present, else CPU); the target may live elsewhere."""
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    t0 = time.time()
    k = spec.draft_steps
    ex, held = examples(model, train_seqs, k), examples(model, heldout_seqs, k)
    hidden_seconds = time.time() - t0
    cfg = model.config
    config = DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                           exit_dim=spec.exit_dim or cfg.hidden_size, num_draft_layers=spec.layers, rnn=True,
                           trained_draft_len=k)
    device = resolve_device(str(device or "auto"))
    drafter = ReDrafter(config)
    head = model.get_output_embeddings()
    drafter.init_from_target((head.dequantized() if hasattr(head, "dequantized") else head.weight).detach().cpu())
    drafter.to(device)
    embed = frozen_embedding(model, device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.1)
    before = accuracy(drafter, embed, held)
    log(f"{len(ex.context)} training / {len(held.context)} held-out positions "
        f"(hidden states in {hidden_seconds:.1f}s); "
        f"held-out top-1 per step before training {before}")
    curve, losses = [], []
    t1 = time.time()
    n = len(ex.context)
    for step in range(1, spec.steps + 1):
        idx = torch.tensor(rng.sample(range(n), min(spec.batch_size, n)))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):  # 3x faster on H200
            loss, _ = step_loss(drafter, embed, _subset(ex, idx, device))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, spec.steps // 8) == 0 or step == spec.steps:
            acc = accuracy(drafter, embed, held)
            curve.append({"step": step, "loss": round(losses[-1], 4), "heldout_top1": acc})
            eta = (time.time() - t1) / step * (spec.steps - step)
            log(f"step {step}/{spec.steps} loss {losses[-1]:.3f} held-out top-1 per step {acc} (eta {eta:.0f}s)")
    report = {"positions": n, "heldout_positions": len(held.context), "hidden_seconds": round(hidden_seconds, 1),
              "train_seconds": round(time.time() - t1, 1), "steps": spec.steps, "batch_size": spec.batch_size,
              "heldout_top1_before": before, "train_loss_first": round(losses[0], 4),
              "train_loss_last": round(sum(losses[-5:]) / len(losses[-5:]), 4),
              "heldout_top1": curve[-1]["heldout_top1"], "curve": curve,
              "parameters": sum(p.numel() for p in drafter.parameters()), "device": str(device)}
    return drafter.cpu(), report


def export(drafter: ReDrafter, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json + model.safetensors in the layout examples/redrafter/convert_checkpoint.py reads.
    The drafter stays bf16 (TensorRT-LLM excludes it from quantization)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(drafter.config.to_json(), indent=2) + "\n")
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def load(folder: Path) -> ReDrafter:
    from server.embedded.redrafter import load_drafter

    return load_drafter(folder)

"""The ReDrafter head in PyTorch, with the parameter names TensorRT-LLM's ReDrafter converter reads.

It lives in the runtime because the embedded engine drafts with it when it serves (speculative
decoding, `server/embedded/speculative.py`); the drafter stage trains and exports it.

Given the target's last hidden state h (final norm applied) at the position that produced token
x1, the head drafts x2, x3, ...: the recurrent state s starts at 0 and takes one token embedding per
step, s = silu(rnn_w(emb(x)) + rnn_u(s)); the logits come from [h ; s] through an optional
`input_proj`, residual blocks x + silu(linear(x)), and a vocabulary head. The token embedding is the
target's own (not a drafter parameter). Names: input_proj.{weight,bias}, lm_head.{i}.linear.{weight,bias},
lm_head.{N}.weight, rnn_u.{weight,bias}, rnn_w.weight.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TOP_K_WARP = 50  # beam search ranks within the top-50 tokens of each step (Apple's warp_logits)


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    vocab_size: int
    exit_dim: int
    num_draft_layers: int
    rnn: bool = True
    trained_draft_len: int = 3
    model_type: str = "recurrent_drafting_drafter"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ReDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h, e = config.hidden_size, config.exit_dim
        if 2 * h != e:
            self.input_proj = nn.Linear(2 * h, e, bias=True)
        self.lm_head = nn.ModuleList([*(ResBlock(e) for _ in range(config.num_draft_layers)),
                                      nn.Linear(e, config.vocab_size, bias=False)])
        if config.rnn:
            self.rnn_u = nn.Linear(h, h, bias=True)
            self.rnn_w = nn.Linear(h, h, bias=False)

    def init_from_target(self, lm_head_weight: torch.Tensor) -> None:
        """Start as the target's own head applied to h: the vocabulary head copies the target's, and
        input_proj passes h through (the state half starts at zero)."""
        h, e = self.config.hidden_size, self.config.exit_dim
        with torch.no_grad():
            if e == h and hasattr(self, "input_proj"):
                self.input_proj.weight.zero_()
                self.input_proj.weight[:, :h].copy_(torch.eye(h))
                self.input_proj.bias.zero_()
                self.lm_head[-1].weight.copy_(lm_head_weight.float())
            for block in self.lm_head[:-1]:
                nn.init.normal_(block.linear.weight, std=0.02 / max(1, e) ** 0.5)
                block.linear.bias.zero_()

    def next_state(self, state: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        if self.config.rnn:
            return F.silu(self.rnn_w(token_emb) + self.rnn_u(state))
        return token_emb + state

    def logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        x = torch.cat([context, state], dim=-1)
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        for layer in self.lm_head:
            x = layer(x)
        return x

    def forward(self, context: torch.Tensor, tokens_emb: torch.Tensor) -> torch.Tensor:
        """Teacher forcing. context [B, H]; tokens_emb [B, K, H]: embeddings of x1..xK.
        Returns logits [B, K, V]: step k predicts x_{k+1} from h and x1..xk."""
        state = torch.zeros_like(context)
        out = []
        for k in range(tokens_emb.shape[1]):
            state = self.next_state(state, tokens_emb[:, k])
            out.append(self.logits(context, state))
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def beam_search(self, context: torch.Tensor, init_token: int, embed: nn.Module, num_beams: int,
                    draft_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft `num_beams` candidates of `draft_len` tokens after `init_token` (the target's own next
        token). context [H]. Returns (beams [W, L] token ids, log P(beam) [W]), best first."""
        w, dev = num_beams, context.device
        ctx = context.float().expand(w, -1)
        beams = torch.full((w, 1), init_token, dtype=torch.long, device=dev)
        # only the first beam is live at the start, or all beams would grow the same tokens
        score = torch.full((w,), float("-inf"), device=dev)
        score[0] = 0.0
        state = torch.zeros_like(ctx)
        for _ in range(draft_len):
            state = self.next_state(state, embed(beams[:, -1]).float())
            logits = self.logits(ctx, state)
            kth = torch.topk(logits, min(TOP_K_WARP, logits.shape[-1]), dim=-1).values[:, -1:]
            logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            total = (score[:, None] + logp).reshape(-1)
            score, idx = torch.topk(total, w)
            parent, token = idx // logits.shape[-1], idx % logits.shape[-1]
            beams = torch.cat([beams[parent], token[:, None]], dim=1)
            state = state[parent]
        return beams[:, 1:], score


def load_drafter(folder: str | Path) -> ReDrafter:
    """A drafter folder (config.json + model.safetensors, as the drafter stage exports it), float32."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_file, weights = folder / "config.json", folder / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"drafter: {f} is missing (a drafter folder has config.json and model.safetensors)")
    try:
        data = json.loads(cfg_file.read_text())
        known = set(DrafterConfig.__dataclass_fields__)
        config = DrafterConfig(**{k: v for k, v in data.items() if k in known})
    except (ValueError, TypeError) as e:
        raise ValueError(f"drafter: {cfg_file} is not a ReDrafter config: {e}") from None
    drafter = ReDrafter(config)
    try:
        drafter.load_state_dict({k: v.float() for k, v in load_file(str(weights)).items()})
    except (RuntimeError, OSError) as e:
        raise ValueError(f"drafter: {weights} does not match {cfg_file}: {e}") from None
    return drafter.eval()


@torch.no_grad()
def int8_vocab_head(drafter: ReDrafter) -> None:
    """Serve the head's vocabulary projection (most of its bytes: 576 x 49152 for the mix) as int8
    weight-only with per-row scales, the CPU's fastest GEMV (`Int8WeightOnlyLinear`). Drafts may
    change a little, never the served tokens: verification decides. The bench reports acceptance in
    serving against the drafter stage's offline figure, which is this step's price."""
    from server.embedded.qlinear import Int8WeightOnlyLinear

    head = drafter.lm_head[-1]
    w = head.weight.detach().float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    drafter.lm_head[-1] = Int8WeightOnlyLinear(q, scale, None, torch.bfloat16)


@torch.no_grad()
def draft_greedy(drafter: ReDrafter, context: torch.Tensor, first: torch.Tensor, embed: nn.Module,
                 draft_len: int) -> torch.Tensor:
    """One beam per row, argmax at every step, all rows at once: context [n, H] (the target's last
    hidden state, final norm applied), first [n] (the target's token from that state) -> [n, L]."""
    dtype = next(drafter.parameters()).dtype
    ctx = context.to(dtype)
    state = torch.zeros_like(ctx)
    tok = first
    out = []
    for _ in range(draft_len):
        state = drafter.next_state(state, embed(tok).to(dtype))
        tok = drafter.logits(ctx, state).argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)

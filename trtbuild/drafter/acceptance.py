"""What a drafter buys, measured without TensorRT-LLM: beam search + greedy verification on held-out data.

At each sampled position t of a held-out target generation: the target's greedy token g (from its
own head on h_t) is the guaranteed token; the drafter beam-searches `num_beams` candidates of
`draft_len` tokens after g; the *real target* then runs each candidate (its KV prefix copied from the
sequence, one decode step per draft position, all beams batched, through the embedded runtime's
slot cache) and a draft token is accepted while it equals the target's argmax there. Per position
the best beam counts. Reported: expected tokens per target step (1 + accepted drafts), acceptance
at each draft position, and that figure as the speed-up bound (verifying a candidate costs about one
target step and drafting nothing; real engines pay a little for both).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from server.embedded.redrafter import ReDrafter
from trtbuild.drafter.data import Sequence
from trtbuild.drafter.train import hidden_states


def positions(seqs: list[Sequence], n: int, seed: int) -> dict[int, list[int]]:
    """Up to n (sequence, t) pairs where the model writes token t+1, sampled evenly; by sequence."""
    cands = [(i, t) for i, s in enumerate(seqs) for t in range(len(s.ids) - 1) if s.generated[t + 1]]
    picked = sorted(random.Random(seed).sample(cands, min(n, len(cands))))
    out: dict[int, list[int]] = {}
    for i, t in picked:
        out.setdefault(i, []).append(t)
    return out


@torch.no_grad()
def measure(model: Any, drafter: ReDrafter, seqs: list[Sequence], num_beams: int, draft_len: int,
            n_positions: int, seed: int = 0) -> dict[str, Any]:
    from server.embedded.runner import SlotRunner
    from trtbuild.drafter.train import device_of, frozen_embedding

    dev = device_of(model)
    drafter = drafter.to(dev)
    embed = frozen_embedding(model, dev)
    longest = max(len(s.ids) for s in seqs) + draft_len + 2
    runner = SlotRunner(model, num_slots=num_beams + 1, max_seq_len=longest)
    source = num_beams  # the slot holding the sequence's own KV
    accepted: list[int] = []
    for i, ts in positions(seqs, n_positions, seed).items():
        ids = seqs[i].ids
        h = hidden_states(model, ids)
        greedy = model.lm_head(h).float().argmax(-1)  # the target's own next token at every position
        h = h.float()
        for start in range(0, len(ids), 512):
            runner.prefill(source, ids[start:start + 512], start)
        for t in ts:
            g = int(greedy[t])
            beams, _ = drafter.beam_search(h[t], g, embed, num_beams, draft_len)
            for b in range(num_beams):
                runner.copy(source, b, t + 1)
            tokens = [g] * num_beams
            ok = torch.ones(num_beams, dtype=torch.bool, device=dev)
            count = torch.zeros(num_beams, dtype=torch.long, device=dev)
            for j in range(draft_len):
                pred = runner.decode(tokens, [t + 1 + j] * num_beams).argmax(-1)
                ok &= beams[:, j] == pred
                count += ok.long()
                if not ok.any():
                    break
                tokens = beams[:, j].tolist()
            accepted.append(int(count.max()))
    n = len(accepted)
    at_least = [sum(a >= j for a in accepted) / n for j in range(1, draft_len + 1)]
    conditional = [at_least[0]] + [at_least[j] / at_least[j - 1] if at_least[j - 1] else 0.0
                                   for j in range(1, draft_len)]
    mean_accepted = sum(accepted) / n
    return {
        "positions": n, "num_beams": num_beams, "draft_len_per_beam": draft_len,
        "mean_accepted_drafts": round(mean_accepted, 4),
        "tokens_per_step": round(1.0 + mean_accepted, 4),
        "acceptance_at_position": [round(x, 4) for x in at_least],  # P(draft j accepted)
        "conditional_acceptance": [round(x, 4) for x in conditional],  # P(j accepted | j-1 accepted)
        "draft_acceptance_rate": round(mean_accepted / draft_len, 4),  # accepted / drafted tokens
        "speedup_bound": round(1.0 + mean_accepted, 4),
        "histogram": {str(a): accepted.count(a) for a in range(draft_len + 1)},
    }

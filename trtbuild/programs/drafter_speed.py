"""Training cost of a ReDrafter head at a given model shape (random data: speed only, not quality).

    python -m trtbuild.programs.drafter_speed --hidden 5120 --vocab 152064 --layers 2 --draft-steps 3 --batch 256

Times full training steps (forward, backward, AdamW) of the head on the chosen device and prints
ms per step, training positions per second, and the time for a given number of positions: the
figure to plan drafter training for a real model with. The target's hidden states are not part of
it (one forward of the target per training sequence, once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

import torch

from server.embedded.redrafter import DrafterConfig, ReDrafter
from trtbuild.drafter.train import Examples, step_loss


def measure(hidden: int, vocab: int, layers: int, draft_steps: int, batch: int, steps: int, device: str,
            exit_dim: int = 0, dtype: str = "float32") -> dict:
    torch.manual_seed(0)
    dev = torch.device(device)
    amp = {"bfloat16": torch.bfloat16, "float32": None}[dtype]
    drafter = ReDrafter(DrafterConfig(hidden_size=hidden, vocab_size=vocab, exit_dim=exit_dim or hidden,
                                      num_draft_layers=layers, trained_draft_len=draft_steps)).to(dev)
    embed = torch.nn.Embedding(vocab, hidden).to(dev).requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    ex = Examples(torch.randn(batch, hidden, device=dev), torch.randint(0, vocab, (batch, draft_steps + 1), device=dev),
                  torch.ones(batch, draft_steps, dtype=torch.bool, device=dev))
    times = []
    for i in range(steps + 3):  # 3 warm-up steps
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            loss, _ = step_loss(drafter, embed, ex)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1000
    return {"hidden": hidden, "vocab": vocab, "layers": layers, "draft_steps": draft_steps, "batch": batch,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": dtype,
            "parameters": sum(p.numel() for p in drafter.parameters()), "ms_per_step": round(ms, 2),
            "positions_per_second": round(batch / ms * 1000, 1),
            "hours_per_100m_positions": round(1e8 / (batch / ms * 1000) / 3600, 2)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtbuild.programs.drafter_speed", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--exit-dim", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.hidden, args.vocab, args.layers, args.draft_steps, args.batch, args.steps,
                             args.device, args.exit_dim, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

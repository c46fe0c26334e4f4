"""Decode speed of the embedded runtime on realistic model shapes, against the memory-bandwidth bound.

    python -m server.bench.gpu --shapes 1.5b,14b --batches 1,8,32 --formats bf16,int8_wo

Random weights (speed only) in Qwen2 shapes, on the GPU when there is one. For each shape, format and
batch size: the slot runner (the embedded engine's forward: the model's own layers, its slot KV cache)
prefills `--context` tokens per sequence, then times `--steps` decode steps (one token for every
sequence; sampling not included). The bound is the bytes a step must read (all weights, plus each
sequence's KV cache) over the device's measured copy bandwidth; the report gives tokens/s, the bound,
and the fraction reached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

SHAPES = {  # Qwen2 configurations (DeepSeek-R1-Distill-Qwen 1.5B / 14B sizes)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(dev: torch.device, gib: float = 4.0) -> float:
    """Bytes per second a device-to-device copy moves, counting read and write."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(dev)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        sync(dev)
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * n * 2 / statistics.median(times)


def build(shape: str, fmt: str, dev: torch.device) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from server.embedded.qlinear import Int8WeightOnlyLinear

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if fmt == "int8_wo":  # per-output-channel symmetric int8, as ModelOpt's W8A16 export
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, lin in list(parent.named_children()):
                    if isinstance(lin, torch.nn.Linear):
                        w = lin.weight.detach().float()
                        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
                        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
                        setattr(parent, name, Int8WeightOnlyLinear(q, scale, lin.bias, torch.bfloat16))
                        del w
    return model


def weight_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    embed = model.get_input_embeddings().weight
    # a decode step reads every weight once, except the embedding table (one row per token)
    return sum(t.numel() * t.element_size() for t in tensors) - embed.numel() * embed.element_size()


@torch.inference_mode()
def run(shape: str, fmt: str, batches: list[int], context: int, steps: int, dev: torch.device, bandwidth: float,
        warmup: int = 10) -> list[dict]:
    from server.embedded.runner import SlotRunner

    t0 = time.time()
    model = build(shape, fmt, dev)
    cfg = model.config
    wbytes = weight_bytes(model)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2  # bf16 K and V
    rows = []
    runner = SlotRunner(model, num_slots=max(batches), max_seq_len=context + steps + warmup + 2,
                        initial_capacity=context + steps + warmup + 2)
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        for slot in range(b):
            runner.prefill(slot, torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist(), 0)
        tokens = torch.randint(0, cfg.vocab_size, (b,), generator=gen).tolist()
        times = []
        for i in range(steps + warmup):
            sync(dev)
            t = time.perf_counter()
            logits = runner.decode(tokens, [context + i] * b)
            sync(dev)
            if i >= warmup:
                times.append(time.perf_counter() - t)
            tokens = logits.argmax(-1).tolist()
        step = statistics.median(times)
        bytes_step = wbytes + b * (context + steps // 2) * kv_per_token
        bound_step = bytes_step / bandwidth
        rows.append({"shape": shape, "format": fmt, "batch": b, "context": context, "step_ms": round(step * 1000, 2),
                     "tok_s": round(b / step, 1), "bound_tok_s": round(b / bound_step, 1),
                     "fraction_of_bound": round(bound_step / step, 3), "weight_gb": round(wbytes / 1e9, 2),
                     "bytes_per_step_gb": round(bytes_step / 1e9, 2)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"[bench_gpu] {shape} {fmt}: built and measured in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    del runner, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1.5b,14b")
    ap.add_argument("--formats", default="bf16,int8_wo")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="untimed decode steps per configuration")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bw = copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"[bench_gpu] {name}: measured copy bandwidth {bw / 1e12:.2f} TB/s", file=sys.stderr, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            rows += run(shape, fmt, [int(b) for b in args.batches.split(",")], args.context, args.steps, dev, bw,
                        args.warmup)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": name, "copy_bandwidth_tb_s": round(bw / 1e12, 3),
                                        "torch": torch.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

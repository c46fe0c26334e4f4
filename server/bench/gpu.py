"""Decode speed of the embedded engine on a GPU, against the memory-bandwidth bound and against
transformers' compiled static-cache generate, measured side by side in one process.

    python -m server.bench.gpu --shapes 1.5b,14b --formats bf16,int8_wo,fp8 --batches 1,8,32 --out bench/gpu.json

Random weights (speed only) in Qwen2 shapes. For each shape, format, context and batch size:
- `runner`: the GraphRunner's decode step alone (one CUDA graph replay per step, no sampling);
- `verify_1_plus_3_ms`: the GraphRunner's verify of 4 tokens a row (a speculative step's target
  forward with 3 drafts), and its ratio to the decode step;
- `engine`: the whole `EmbeddedEngine` (scheduler thread, device sampler, request streams and
  detokenizer), B requests of `context` random prompt tokens generating with ignore_eos; decode
  tokens/s from the difference of two generation lengths, so prefill cancels out;
- `hf_compiled` (bf16 only): transformers' `generate` with `cache_implementation="static"` (which
  transformers compiles itself), the same difference of two lengths;
- the bound: the bytes a step must read (every weight once, plus each sequence's KV) over the
  measured device-to-device copy bandwidth.
Plus, per shape, the GraphRunner's agreement with the CPU-style SlotRunner on the same device
(greedy tokens and KL of the next-token distributions over decode steps): what the fused GEMMs and
CUDA graphs change numerically.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Iterator, Optional

import torch

from server.bench.device import copy_bandwidth, cuda_device, gpu_environment, grid_arguments, write_rows

SHAPES = {  # Qwen2 configurations (DeepSeek-R1-Distill-Qwen 1.5B / 7B / 14B sizes)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
}


def log(msg: str) -> None:
    print(f"[bench.gpu] {msg}", file=sys.stderr, flush=True)


def quantize_linears(model: Any, fmt: str) -> None:
    """Replace the decoder's linears as ModelOpt's exports would be served (per-channel int8, or
    per-tensor FP8 with a calibrated-like input scale)."""
    from server.embedded.qlinear import FP8_MAX, Fp8Linear, Int8WeightOnlyLinear

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                w = lin.weight.detach().float()
                if fmt == "int8_wo":
                    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
                    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
                    new: torch.nn.Module = Int8WeightOnlyLinear(q, scale, lin.bias, torch.bfloat16)
                else:
                    scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12)
                    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                    new = Fp8Linear(q, scale, torch.tensor(0.05), lin.bias, torch.bfloat16)
                setattr(parent, name, new.to(w.device))
                del w, q


def build(shape: str, fmt: str, dev: torch.device) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if fmt != "bf16":
        quantize_linears(model, fmt)
    return model


def weight_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    embed = model.get_input_embeddings().weight
    # a decode step reads every weight once, except the embedding table (one row per token)
    return sum(t.numel() * t.element_size() for t in tensors) - embed.numel() * embed.element_size()


def word_tokenizer(vocab: int) -> Any:
    """A real (tokenizers-library) tokenizer that decodes every id of a random model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0")


@torch.inference_mode()
def runner_decode(runner: Any, vocab: int, b: int, context: int, steps: int, warmup: int = 5) -> float:
    """Median seconds of one decode step for b sequences at `context` tokens (graph replay)."""
    gen = torch.Generator().manual_seed(0)
    for slot in range(b):
        runner.prefill(slot, torch.randint(0, vocab, (context,), generator=gen).tolist(), 0)
    tokens = torch.randint(0, vocab, (b,), generator=gen).tolist()
    times = []
    for i in range(steps + warmup):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = runner.decode(tokens, [context + i] * b)
        tokens = logits.argmax(-1).tolist()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def runner_verify(runner: Any, vocab: int, b: int, context: int, steps: int, tokens: int = 4, warmup: int = 3
                  ) -> float:
    """Median seconds of one verify step (`tokens` tokens a row: the pending token and its drafts) for
    b sequences at `context` tokens, the slots already prefilled by `runner_decode`: what a speculative
    step costs the target, against one decode step."""
    gen = torch.Generator().manual_seed(4)
    times = []
    for i in range(steps + warmup):
        rows = torch.randint(0, vocab, (b, tokens), generator=gen).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.verify(rows, [context] * b).argmax(-1).tolist()  # the same host round trip as a decode step
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def agreement(model: Any, vocab: int, context: int, steps: int = 32, b: int = 4) -> dict[str, float]:
    """GraphRunner (fused GEMMs, graphs, buckets) vs SlotRunner on the same weights and device."""
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.runner import SlotRunner

    seq = context + steps + 2
    ref, fast = SlotRunner(model, b, seq, seq), GraphRunner(model, b, seq)
    gen = torch.Generator().manual_seed(1)
    for slot in range(b):
        p = torch.randint(0, vocab, (context,), generator=gen).tolist()
        ref.prefill(slot, p, 0)
        fast.prefill(slot, p, 0)
    tokens, same, kls = torch.randint(0, vocab, (b,), generator=gen).tolist(), 0, []
    for i in range(steps):
        la, lb = ref.decode(tokens, [context + i] * b), fast.decode(tokens, [context + i] * b)
        pa, lpb = torch.log_softmax(la, -1), torch.log_softmax(lb, -1)
        kls.append(float((pa.exp() * (pa - lpb)).sum(-1).mean()))
        ta, tb = la.argmax(-1).tolist(), lb.argmax(-1).tolist()
        same += sum(x == y for x, y in zip(ta, tb))
        tokens = ta
    del ref, fast
    return {"token_agreement": round(same / (steps * b), 4), "kl_mean": statistics.mean(kls)}


# How the engine rows' requests sample (`--sampling`): greedy, or the recipes' AIMO sampling (engines/mix.yaml),
# drawn by the fused Triton draw (sample_kernel.py) or, as `recipe_eager`, by the eager one it replaced
SAMPLINGS = {"greedy": {"temperature": 0.0}, "recipe": {"temperature": 0.7, "top_p": 0.95},
             "recipe_eager": {"temperature": 0.7, "top_p": 0.95}}


@contextlib.contextmanager
def sampler_for(sampling: str) -> Iterator[None]:
    """The device draw `sampling` names: the eager one for `recipe_eager` (FUSED_SAMPLER_ENV), else the default."""
    from server.embedded import sampler

    before = os.environ.get(sampler.FUSED_SAMPLER_ENV)
    if sampling == "recipe_eager":
        os.environ[sampler.FUSED_SAMPLER_ENV] = "0"
    sampler.fused_sampler.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(sampler.FUSED_SAMPLER_ENV, None)
        else:
            os.environ[sampler.FUSED_SAMPLER_ENV] = before
        sampler.fused_sampler.cache_clear()


def engine_decode(engine: Any, vocab: int, b: int, context: int, short: int, long: int,
                  sampling: str = "greedy") -> dict[str, float]:
    """Decode tok/s of the whole engine at batch b: b requests admitted together, timed from the moment
    every one has its first token to the moment the first one ends, so every step in the window runs
    the full batch (a request that started a step late finishes a step late, alone). Tokens are
    counted from each delta's token ids (a delta may carry several when the stream coalesces).
    Requests sample as SAMPLINGS[sampling] says (seeded: every run draws the same tokens)."""
    from aimo_spec.protocol import Delta, Request, SamplingParams

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(b)]

    async def one(i: int, p: list[int], n: int, deltas: list[tuple[float, int]]) -> float:
        params = SamplingParams(**SAMPLINGS[sampling], seed=i, max_tokens=n, ignore_eos=True)
        async for ev in engine.generate(Request(p, params)):
            if isinstance(ev, Delta) and ev.token_ids:
                deltas.append((time.perf_counter(), len(ev.token_ids)))
        return time.perf_counter()

    async def run(n: int) -> float:
        stamps: list[list[tuple[float, int]]] = [[] for _ in prompts]
        ends = await asyncio.gather(*(one(i, p, n, stamps[i]) for i, p in enumerate(prompts)))
        start = max(s[0][0] for s in stamps)  # every request is decoding from here on
        end = min(s[-1][0] for s in stamps)  # ... until the first one's last token
        if end <= start:  # one request ended before the last began: no full-batch window, take the whole run
            end = max(ends)
        tokens = sum(k for s in stamps for t, k in s if start < t <= end)
        return tokens / max(1e-9, end - start)

    asyncio.run(run(4))  # warm-up: graphs for this batch and context captured
    # every run prefills b x context tokens again: at long contexts that, not the decode, takes the time
    repeats = 3 if b * context <= 16 * 4096 else 1
    return {"tok_s": round(statistics.median(asyncio.run(run(long)) for _ in range(repeats)), 1)}


@torch.inference_mode()
def hf_compiled(model: Any, vocab: int, b: int, context: int, short: int, long: int) -> Optional[float]:
    """transformers' generate with a static cache (which it compiles itself): decode tok/s."""
    from transformers import GenerationConfig

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (b, context), generator=gen).to(model.device)

    def run(n: int) -> float:
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                              pad_token_id=0, eos_token_id=None)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    try:
        run(long)  # compiles
        run(long)
        return b * (long - short) / max(1e-9, run(long) - run(short))
    except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
        log(f"transformers compiled generate failed: {type(e).__name__}: {e}")
        return None


def measure(shape: str, fmt: str, batches: list[int], contexts: list[int], dev: torch.device, bandwidth: float,
            steps: int, compile: bool, peers: bool, check: bool, kv_dtypes: tuple[str, ...] = ("auto",),
            overlap_baseline: bool = False, samplings: tuple[str, ...] = ("greedy",)) -> list[dict]:
    """Rows of runner and engine figures for one shape and weight format; the engine's with each of
    `samplings` (the first as `engine_tok_s`, the others as `engine_<name>_tok_s` beside it)."""
    from server.embedded.engine import EmbeddedEngine
    from server.embedded.graph_runner import GraphRunner

    t0 = time.time()
    model = build(shape, fmt, dev)
    cfg = model.config
    vocab = cfg.vocab_size
    wbytes = weight_bytes(model)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # bytes a token's K and V take in every layer: bf16, or e4m3 plus one float32 scale a vector
    kv_bytes = {"auto": cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2,
                "fp8": cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (head_dim + 4)}
    rows = []
    extra = {}
    if check:
        extra = agreement(model, vocab, min(contexts))
        log(f"{shape} {fmt}: GraphRunner vs SlotRunner on the GPU: {extra}")
    max_seq = max(contexts) + 2 * steps + 80
    for kv in kv_dtypes:
        runner = GraphRunner(model, max(batches), max_seq, compile=compile, kv_cache_dtype=kv)
        kv_rows = []
        for context in contexts:
            for b in batches:
                step = runner_decode(runner, vocab, b, context, steps)
                verify = runner_verify(runner, vocab, b, context, max(4, steps // 2))
                bytes_step = wbytes + b * (context + steps // 2) * kv_bytes[kv]
                bound = b / (bytes_step / bandwidth)
                kv_rows.append({"shape": shape, "format": fmt, "kv_cache": kv,
                                "attention": runner.attention,
                                "batch": b, "context": context, "compile": compile,
                                "runner_tok_s": round(b / step, 1), "runner_step_ms": round(step * 1e3, 3),
                                "verify_1_plus_3_ms": round(verify * 1e3, 3),
                                "verify_over_step": round(verify / step, 3),
                                "bound_tok_s": round(bound, 1), "runner_fraction_of_bound": round(b / step / bound, 3),
                                "weight_gb": round(wbytes / 1e9, 2), **extra})
                log(json.dumps(kv_rows[-1]))
        del runner
        gc.collect()  # the runner's captured graphs and their pool go with it, before the engine allocates its own
        torch.cuda.empty_cache()
        # the engine as served (overlap on), then, if asked, with each step streamed before the next is launched
        for overlap in (True, False) if overlap_baseline else (True,):
            engine = EmbeddedEngine(model, word_tokenizer(vocab), max_batch_size=max(batches), max_seq_len=max_seq,
                                    prefix_reuse=False, device=str(dev), compile=compile, kv_cache_dtype=kv,
                                    overlap=overlap)
            try:
                for row in kv_rows:
                    for other in samplings[1:] if overlap else ():
                        with sampler_for(other):
                            e = engine_decode(engine, vocab, row["batch"], row["context"], 8, 8 + 2 * steps, other)
                        log(f"{shape} {fmt} kv={kv} b={row['batch']} ctx={row['context']} {other}: engine {e}")
                        row[f"engine_{other}_tok_s"] = e["tok_s"]
                    with sampler_for(samplings[0]):
                        e = engine_decode(engine, vocab, row["batch"], row["context"], 8, 8 + 2 * steps, samplings[0])
                    log(f"{shape} {fmt} kv={kv} b={row['batch']} ctx={row['context']} overlap={overlap}: engine {e}")
                    row["sampling"] = samplings[0]
                    if not overlap:
                        row["engine_no_overlap_tok_s"] = e["tok_s"]
                        continue
                    # the engine's own cost (scheduler, sampler, streams) is what it loses against its runner alone
                    row.update({"engine_tok_s": e["tok_s"],
                                "engine_fraction_of_bound": round(e["tok_s"] / row["bound_tok_s"], 3),
                                "engine_overhead_fraction": round(1 - e["tok_s"] / row["runner_tok_s"], 3)})
            finally:
                engine.shutdown()
                del engine  # its cache is freed before the next engine allocates one
                gc.collect()
                torch.cuda.empty_cache()
        rows += kv_rows
    if peers and fmt == "bf16":
        for row in rows:
            if row["context"] == min(contexts) and row["batch"] <= 8 and row["kv_cache"] == "auto":
                hf = hf_compiled(model, vocab, row["batch"], row["context"], steps // 2, steps + steps // 2)
                row["hf_compiled_tok_s"] = None if hf is None else round(hf, 1)
                if hf:
                    row["engine_vs_hf_compiled"] = round(row["engine_tok_s"] / hf, 2)
                log(f"{shape} b={row['batch']}: transformers compiled static generate {hf}")
    log(f"{shape} {fmt}: built and measured in {time.time() - t0:.0f}s")
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.gpu", description=__doc__.splitlines()[0])
    grid_arguments(ap, SHAPES, shapes="1.5b,14b", batches="1,8,32", contexts="512")
    ap.add_argument("--formats", default="bf16,int8_wo,fp8")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-cache", default="auto", help="KV cache dtypes to measure: auto (the model's), fp8")
    ap.add_argument("--compile", action="store_true", help="torch.compile the GraphRunner's elementwise work")
    ap.add_argument("--overlap-baseline", action="store_true",
                    help="also measure the engine with overlap off (each step streamed before the next launch)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers' compiled generate")
    ap.add_argument("--no-check", action="store_true", help="skip the GraphRunner vs SlotRunner agreement")
    ap.add_argument("--sampling", default="greedy",
                    help="how the engine's requests sample, comma-separated (the first gives engine_tok_s): "
                    + ", ".join(SAMPLINGS))
    args = ap.parse_args(argv)
    samplings = tuple(args.sampling.split(","))
    if not samplings or any(s not in SAMPLINGS for s in samplings):
        ap.error(f"--sampling {args.sampling!r}: each of {', '.join(SAMPLINGS)}")
    dev = cuda_device("bench.gpu")
    if dev is None:
        return 2
    bw = copy_bandwidth(dev)
    meta = {**gpu_environment(), "copy_bandwidth_tb_s": round(bw / 1e12, 3)}
    log(f"{meta['gpu']}: measured copy bandwidth {bw / 1e12:.2f} TB/s, torch {torch.__version__}")
    rows = []
    for shape in args.shapes:
        for fmt in args.formats.split(","):
            try:
                rows += measure(shape, fmt, args.batches, args.contexts, dev, bw, args.steps, args.compile,
                                not args.no_peers, not args.no_check, tuple(args.kv_cache.split(",")),
                                args.overlap_baseline, samplings)
            except Exception as e:  # noqa: BLE001 - one failing configuration must not lose the others
                import traceback

                traceback.print_exc()
                rows.append({"shape": shape, "format": fmt, "error": f"{type(e).__name__}: {e}"})
            write_rows(args.out, meta, rows)  # after each configuration: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())

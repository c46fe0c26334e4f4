"""What deterministic mode buys and costs, measured side by side in one run on one engine folder.

    python -m server.bench.deterministic --engine engines/mix/build/embedded [--device cpu]
                                         [--out bench/deterministic-cpu.json]

For the default engine and for deterministic mode (server/embedded/deterministic.py), in turn:
1. Equality: `--prompts` chat prompts, greedy, each alone (one after another), then all together, then
   all together in reverse order: how many come back token for token the same as alone, and how many
   with bit-identical logprobs.
2. Throughput: aggregate generated tokens/s with 1, 4 and 8 concurrent requests of fixed length
   (end-of-sequence ignored), the median of `--repeats` runs, and deterministic / default per batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aimo_spec.protocol import Request, SamplingParams, collect


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def questions(n: int) -> list[str]:
    """AIMO-like problems of about 110 tokens, so that repeated prompts reuse KV in both modes."""
    return [f"Let $S$ be the set of positive integers $k \\le {100 + 7 * i}$ such that ${7 * i + 3}^k + k$ is "
            f"divisible by {11 + i}. Find the remainder when the sum of the elements of $S$ is divided by 1000. "
            "Think step by step, use python to check your arithmetic, and put the final answer in \\boxed{}."
            for i in range(n)]


async def _greedy(engine: Any, prompt: list[int], tokens: int) -> tuple[tuple[int, ...], tuple]:
    deltas, final = await collect(engine, Request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                         top_logprobs=2)))
    return tuple(final.token_ids), tuple(lp for d in deltas for lp in (d.logprobs or ()))


def equality(engine: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    async def alone() -> list:
        return [await _greedy(engine, p, tokens) for p in prompts]

    async def together(order: list[int]) -> list:
        got = await asyncio.gather(*(_greedy(engine, prompts[i], tokens) for i in order))
        return [got[order.index(i)] for i in range(len(prompts))]
    ref = asyncio.run(alone())
    out: dict[str, Any] = {"prompts": len(prompts), "tokens": tokens}
    forward = list(range(len(prompts)))
    for name, order in (("together", forward), ("together_reversed", forward[::-1])):
        got = asyncio.run(together(order))
        out[f"{name}_same_tokens"] = sum(g[0] == r[0] for g, r in zip(got, ref))
        out[f"{name}_same_logprobs"] = sum(g == r for g, r in zip(got, ref))
    return out


def throughput(engine: Any, prompts: list[list[int]], batch: int, tokens: int, repeats: int) -> float:
    async def go() -> int:
        reqs = [Request(prompts[i % len(prompts)], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
                for i in range(batch)]
        finals = await asyncio.gather(*(collect(engine, r) for r in reqs))
        return sum(len(f.token_ids) for _, f in finals)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = asyncio.run(go())
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure(engine_dir: Path, device: str, deterministic: bool, args: argparse.Namespace) -> dict[str, Any]:
    from server.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_dir(engine_dir, device=device, deterministic=deterministic, speculative="off",
                                     **({"threads": args.threads} if args.threads else {}))
    try:
        prompts = [engine.tokenize(engine.chat_prompt(q)) for q in questions(args.prompts)]
        asyncio.run(_greedy(engine, prompts[0], 4))  # warm up
        eq = equality(engine, prompts, args.tokens)
        log(f"[deterministic] {'deterministic' if deterministic else 'default'}: same tokens together "
            f"{eq['together_same_tokens']}/{eq['prompts']}, "
            f"reversed {eq['together_reversed_same_tokens']}/{eq['prompts']}; "
            f"same logprobs {eq['together_same_logprobs']}/{eq['prompts']}")
        rates = {}
        for b in args.batches:
            rates[str(b)] = round(throughput(engine, prompts, b, args.tokens, args.repeats), 2)
            mode = "deterministic" if deterministic else "default"
            log(f"[deterministic] {mode}: batch {b}: {rates[str(b)]:.1f} tok/s")
        return {"equality": eq, "tokens_per_second": rates, "runner": engine.runner_kind}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.deterministic", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, type=Path, help="an embedded engine folder or an HF checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch
    import transformers

    results = {m: measure(args.engine, args.device, m == "deterministic", args) for m in ("default", "deterministic")}
    ratios = {b: round(results["deterministic"]["tokens_per_second"][b] / results["default"]["tokens_per_second"][b], 3)
              for b in results["default"]["tokens_per_second"]}
    report = {"date": time.strftime("%Y-%m-%d"), "engine": str(args.engine), "device": args.device,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores" + (
                  f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "tokens": args.tokens, "repeats": args.repeats, "results": results,
              "deterministic_over_default": ratios}
    log(f"[deterministic] tok/s deterministic / default by batch: {ratios}")
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark on a built embedded engine, everything measured side by side in one run.

    python -m server.bench.serving --recipe engines/mix.yaml [--tokens 64] [--out bench/serving.json]

1. Throughput, aggregate generated tokens/s at 1, 4, 8, 16 concurrent requests (fixed length,
   end-of-sequence ignored), through:
   - the embedded engine with in-flight batching (this project's scheduler over SlotRunner),
   - the same engine, the same requests one at a time (sequential),
   - transformers' own continuous batching (`generate_batch`) on the same weights: the library
     alternative, measured so that the choice of scheduler is a measured one.
   The median of `--repeats` runs is reported (`--library-repeats` for the library), with the ratios
   in-flight / sequential and in-flight / library.
2. Harness overhead: the solver (TIR client, sandbox, voting) on shipped problems; client work on
   streamed deltas plus the engine's scheduling bookkeeping, per generated token, as a fraction of
   the model's forward time per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aimo_spec.protocol import Final, Request, SamplingParams
from server.tables import format_table


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    from aimo_spec.chat import encode, render_prompt

    return [encode(tokenizer, render_prompt(tokenizer, f"What is the sum of the integers from {i} to {10 * i + 7}?"))
            for i in range(1, n + 1)]


async def _drain(engine: Any, request: Request) -> Final:
    async for ev in engine.generate(request):
        if isinstance(ev, Final):
            return ev
    raise RuntimeError("no final message")


def engine_throughput(engine: Any, prompts: list[list[int]], tokens: int, concurrent: bool,
                      temperature: float = 0.7, top_p: float = 0.95) -> float:
    """Generated tokens/s of seeded requests (request i: seed i), all at once or one after another."""
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=tokens, ignore_eos=True)
              for i in range(len(prompts))]

    async def go() -> int:
        if concurrent:
            finals = await asyncio.gather(*[_drain(engine, Request(p, sp)) for p, sp in zip(prompts, params)])
        else:
            finals = [await _drain(engine, Request(p, sp)) for p, sp in zip(prompts, params)]
        bad = [f for f in finals if f.finish_reason != "length"]
        if bad:
            raise RuntimeError(f"benchmark request ended with {bad[0].finish_reason}: {bad[0].error}")
        return sum(len(f.token_ids) for f in finals)

    t0 = time.perf_counter()
    n = asyncio.run(go())
    return n / (time.perf_counter() - t0)


def library_throughput(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> float:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=tokens, do_sample=True, temperature=0.7, top_p=0.95, eos_token_id=-1,
                          pad_token_id=tokenizer.pad_token_id)
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gc, progress_bar=False)
    n = sum(len(o.generated_tokens) for o in out.values())
    return n / (time.perf_counter() - t0)


def harness_overhead(recipe: Any, engine: Any, problems_file: str, limit: int) -> dict[str, Any]:
    from server.assembly import build_solver, sandbox_for
    from server.budget import TimeBudget
    from server.problems import read_problems, run_problems

    problems = read_problems(problems_file)[:limit]
    sandbox = sandbox_for(recipe.serving.tool)
    try:
        solver = build_solver(recipe.serving, engine, sandbox)
        budget = TimeBudget(recipe.serving.budget, len(problems))
        s = engine.stats
        f0, b0, k0, s0 = s.forward_seconds, s.bookkeeping_seconds, s.decode_tokens, s.sample_seconds
        report = asyncio.run(run_problems(solver, problems, budget, None, lambda: s.busy_seconds, progress=log))
    finally:
        sandbox.close()
    traces = [t for r in report.results for t in r.traces]
    tokens = sum(t.tokens for t in traces)
    client = sum(t.client_seconds for t in traces)
    forward = s.forward_seconds - f0
    bookkeeping = s.bookkeeping_seconds - b0
    sampling = s.sample_seconds - s0
    per_tok = lambda x: 1e3 * x / max(1, tokens)  # noqa: E731
    return {
        "problems": len(problems), "correct": report.correct, "tokens": tokens, "wall_seconds": report.wall_seconds,
        "tokens_per_second": tokens / report.wall_seconds,
        "forward_ms_per_token": per_tok(forward), "sampling_ms_per_token": per_tok(sampling),
        "scheduler_ms_per_token": per_tok(bookkeeping), "client_ms_per_token": per_tok(client),
        "overhead_fraction": (client + bookkeeping) / forward if forward else None,
        "overhead_fraction_with_sampling": (client + bookkeeping + sampling) / forward if forward else None,
        "decode_tokens": s.decode_tokens - k0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="engines/mix.yaml")
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per request")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--library-repeats", type=int, default=1, help="the library is slow on CPU: fewer runs")
    ap.add_argument("--problems", default="engines/problems/smoke.csv")
    ap.add_argument("--harness-problems", type=int, default=4)
    ap.add_argument("--no-library", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--out", default="bench/serving.json")
    args = ap.parse_args(argv)

    from aimo_spec.recipe import load_recipe
    from server.backends import open_for_recipe
    from server.embedded.engine import EmbeddedEngine

    recipe = load_recipe(args.recipe, check_paths=False)  # serving needs the built engine, not the sources
    engine: EmbeddedEngine = open_for_recipe(recipe, "embedded")
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = bench_prompts(engine.tokenizer, max(levels))
    engine_throughput(engine, prompts[:2], 8, True)  # warm-up
    if not args.no_library:
        engine.call_in_engine_thread(lambda: library_throughput(engine.model, engine.tokenizer, prompts[:2], 8))
    rows = []
    for c in levels:
        runs: dict[str, list[float]] = {"in_flight": [], "sequential": [], "library_cb": []}
        for r in range(args.repeats):
            runs["in_flight"].append(engine_throughput(engine, prompts[:c], args.tokens, True))
            runs["sequential"].append(engine_throughput(engine, prompts[:c], args.tokens, False))
            if not args.no_library and r < args.library_repeats:
                runs["library_cb"].append(engine.call_in_engine_thread(  # same thread: same OpenMP pool
                    lambda: library_throughput(engine.model, engine.tokenizer, prompts[:c], args.tokens)))
        med = {k: statistics.median(v) for k, v in runs.items() if v}
        row = {"concurrency": c, **{f"{k}_tok_s": v for k, v in med.items()},
               "in_flight_vs_sequential": med["in_flight"] / med["sequential"]}
        if "library_cb" in med:
            row["in_flight_vs_library"] = med["in_flight"] / med["library_cb"]
        rows.append(row)
        log(f"[bench] {c:>2} concurrent: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in med.items()))
    log("[bench] harness overhead: solving shipped problems ...")
    overhead = harness_overhead(recipe, engine, args.problems, args.harness_problems)
    engine.shutdown()

    print(f"embedded engine ({recipe.build.quantization}, {args.tokens} tokens per request, "
          f"median of {args.repeats}); aggregate tok/s")
    print(format_table(rows, [("concurrent", "concurrency", ">10"), ("in-flight", "in_flight_tok_s", ">10.1f"),
                              ("sequential", "sequential_tok_s", ">10.1f"),
                              ("library CB", "library_cb_tok_s", ">10.1f"),
                              ("in-flight/seq", "in_flight_vs_sequential", ">13.2f"),
                              ("in-flight/lib", "in_flight_vs_library", ">13.2f")]))
    o = overhead
    print(f"harness ({o['problems']} problems, {o['tokens']} tokens, {o['tokens_per_second']:.1f} tok/s whole run): "
          f"forward {o['forward_ms_per_token']:.2f} ms/token, sampling {o['sampling_ms_per_token']:.2f}, "
          f"scheduler {o['scheduler_ms_per_token']:.2f}, client {o['client_ms_per_token']:.2f}; "
          f"overhead (client + scheduler) / forward = {100 * o['overhead_fraction']:.1f}% "
          f"({100 * o['overhead_fraction_with_sampling']:.1f}% with sampling)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "recipe": str(args.recipe),
                               "quantization": recipe.build.quantization, "tokens_per_request": args.tokens,
                               "repeats": args.repeats, "throughput": rows, "harness": overhead}, indent=2))
    log(f"[bench] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

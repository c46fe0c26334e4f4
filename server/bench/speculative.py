"""What speculative decoding buys the embedded engine: tokens/s with and without the drafter, side by side.

    python -m server.bench.speculative --recipe engines/mix.yaml [--batches 1,4,8] [--tokens 128] \
        [--device auto] [--out bench/speculative.json]

The same engine folder is served twice per repeat, with its ReDrafter head (drafting at every batch
size, whatever the device's switch-off default) and without it; both get the same work, B of the
shipped problems at a time, under the recipe's sampling and greedily: `--workload plain` (default)
generates from the chat prompts without tools, which measures the engine; `--workload tir` runs the
real TIR client (code in the sandbox, output blocks fed back, as `make solve` does), which measures
the whole harness, session starts and tool time included. The rate is generated tokens over wall
time. Greedy runs are token for token the same with and without the drafter (exactness), so that
comparison is of identical work. Each row
gives the median tokens/s of both, their ratio, where the time per token goes, and the tokens per
sequence per step in serving next to the drafter stage's offline figure (`drafter/acceptance.json`). The largest batch
at which drafting still wins is printed against the engine's default switch-off batch for the
device (`speculative.DEFAULT_MAX_BATCH`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from server.tables import format_table


def log(msg: str) -> None:
    print(f"[bench.speculative] {msg}", file=sys.stderr, flush=True)


def problem_prompts(engine: Any, problems_file: str, n: int) -> list[list[int]]:
    from server.problems import read_problems

    problems = read_problems(problems_file)
    texts = [problems[i % len(problems)].text for i in range(n)]
    return [engine.tokenize(engine.chat_prompt(t)) for t in texts]


def timed_batch(go: Callable[[], Awaitable[list[Any]]], outcome: Callable[[Any], tuple[str, str, int]], what: str
                ) -> tuple[float, int]:
    """Run one batch (`go`) on the clock: (generated tokens per second of wall time, tokens). `outcome` reads
    each result's (finish reason, error, tokens); a result that did not end by stop or length fails the run."""
    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    ends = [outcome(r) for r in results]
    bad = [e for e in ends if e[0] not in ("stop", "length")]
    if bad:
        raise RuntimeError(f"benchmark {what} ended with {bad[0][0]}: {bad[0][1]}")
    tokens = sum(e[2] for e in ends)
    return tokens / wall, tokens


def plain_throughput(engine: Any, sandbox: Any, serving: Any, prompts: list[list[int]], seed0: int
                     ) -> tuple[float, int]:
    """B plain requests at once (no tools): the engine's own speed, (tokens per second, tokens)."""
    from aimo_spec.protocol import Final, Request, SamplingParams

    s = serving.sampling
    params = [SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                             seed=seed0 + i) for i in range(len(prompts))]

    async def one(p: list[int], sp: Any) -> Final:
        async for ev in engine.generate(Request(p, sp)):
            if isinstance(ev, Final):
                return ev
        raise RuntimeError("no final message")

    async def go() -> list[Final]:
        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    return timed_batch(go, lambda f: (f.finish_reason, f.error, len(f.token_ids)), "request")


def tir_throughput(engine: Any, sandbox: Any, serving: Any, prompts: list[list[int]], seed0: int
                   ) -> tuple[float, int]:
    """B TIR samples at once to their ends: (generated tokens per second of wall time, tokens)."""
    from server.assembly import tir_client

    client = tir_client(serving, engine, sandbox, serving.sampling.max_tokens)

    async def go() -> list[Any]:
        return await asyncio.gather(*(client.run(p, i, seed0 + i) for i, p in enumerate(prompts)))

    return timed_batch(go, lambda t: (t.finish, t.error, t.tokens), "sample")


def open_engine(engine_dir: Path, speculative: bool, serving: Any, threads: Optional[int] = None) -> Any:
    """The engine folder served with `serving` (its device included), drafting or not."""
    from server.embedded.engine import EmbeddedEngine

    # both runs on the main weights, the ones the drafter drafts for (a CPU would serve the plain run from
    # the folder's CPU weights otherwise: build.cpu_quantization)
    kw: dict[str, Any] = {"speculative": "on" if speculative else "off", "threads": threads, "weights": "main"}
    if speculative:
        kw["speculative_max_batch"] = 10**6  # draft at every batch size: the switch-off is what we measure
    return EmbeddedEngine.from_dir(engine_dir, serving=serving, **kw)


def measure(engine_dir: Path, batches: list[int], tokens: int, repeats: int, serving: Any,
            problems: str, threads: Optional[int] = None, workload: str = "plain") -> list[dict[str, Any]]:
    import dataclasses

    from server.assembly import sandbox_for

    def with_sampling(**kw: Any) -> Any:
        return dataclasses.replace(serving, sampling=dataclasses.replace(serving.sampling, max_tokens=tokens, **kw))

    modes = {"recipe sampling": with_sampling(), "greedy": with_sampling(temperature=0.0)}
    runs: dict[tuple[str, int, bool], list[float]] = {}
    spec_stats: dict[tuple[str, int], list[float]] = {}
    costs: dict[tuple[str, int, bool], list[list[float]]] = {}  # ms per generated token, steps per token
    run = tir_throughput if workload == "tir" else plain_throughput
    sandbox = sandbox_for(serving.tool) if workload == "tir" else None
    try:
        for r in range(repeats):
            for speculative in (True, False):
                engine = open_engine(engine_dir, speculative, serving, threads)
                try:
                    prompts = problem_prompts(engine, problems, max(batches))
                    # warm-up at every batch size and length: CUDA graphs are captured per (batch,
                    # context, tokens per row) bucket on first use, which must not land in a timed run
                    for b in batches:
                        run(engine, sandbox, modes["greedy"], prompts[:b], 0)
                    for mode, sv in modes.items():
                        for b in batches:
                            st = engine.stats
                            s0 = (st.spec_rows, st.accepted_draft_tokens)
                            c0 = (st.forward_seconds, st.sample_seconds, st.busy_seconds, st.steps)
                            tps, n_tok = run(engine, sandbox, sv, prompts[:b], 1000 * r)
                            runs.setdefault((mode, b, speculative), []).append(tps)
                            n_tok = max(1, n_tok)
                            split = [(getattr(st, k) - v) * 1e3 / n_tok for k, v in
                                     zip(("forward_seconds", "sample_seconds", "busy_seconds"), c0)]
                            costs.setdefault((mode, b, speculative), []).append(split + [(st.steps - c0[3]) / n_tok])
                            if speculative:
                                rows = st.spec_rows - s0[0]
                                acc = st.accepted_draft_tokens - s0[1]
                                spec_stats.setdefault((mode, b), []).append(1.0 + acc / rows if rows else 1.0)
                            log(f"repeat {r + 1}/{repeats} {mode:>15} batch {b:>2} "
                                f"{'with' if speculative else 'without'} drafter: {tps:.1f} tok/s")
                finally:
                    engine.shutdown()
    finally:
        if sandbox is not None:
            sandbox.close()
    out = []
    for mode in modes:
        for b in batches:
            on, off = statistics.median(runs[(mode, b, True)]), statistics.median(runs[(mode, b, False)])
            row: dict[str, Any] = {"mode": mode, "batch": b, "with_drafter_tok_s": round(on, 2),
                                   "without_tok_s": round(off, 2), "speedup": round(on / off, 3),
                                   "tokens_per_step": round(statistics.median(spec_stats[(mode, b)]), 3)}
            for flag, name in ((True, "with"), (False, "without")):  # where the time per token goes (medians)
                cols = list(zip(*costs[(mode, b, flag)]))
                row[f"{name}_ms_per_token"] = {k: round(statistics.median(c), 3) for k, c in
                                               zip(("forward", "sample", "engine_busy", "steps_per_token"), cols)}
            out.append(row)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.speculative", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="engines/mix.yaml")
    ap.add_argument("--engine", type=Path, default=None, help="engine folder (default: the recipe's build/embedded)")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=256, help="max tokens per sample (all turns)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None, help="auto | cpu | cuda[:N] (default: the recipe's serving.device)")
    ap.add_argument("--problems", default="engines/problems/smoke.csv")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of the engine (default: every core)")
    ap.add_argument("--workload", choices=("plain", "tir"), default="plain",
                    help="plain: chat prompts generated without tools (the engine's speed); tir: the TIR client "
                         "with the sandbox (end to end, tool time included)")
    ap.add_argument("--out", type=Path, default=Path("bench/speculative.json"))
    args = ap.parse_args(argv)

    import torch

    from aimo_spec.recipe import load_recipe
    from server.embedded.settings import resolve_device, serving_settings
    from server.embedded.speculative import DEFAULT_MAX_BATCH

    recipe = load_recipe(args.recipe, check_paths=False)  # serving needs the built engine, not the sources
    serving = serving_settings(recipe, device=args.device)
    engine_dir = args.engine or recipe.layout.engine("embedded")
    spec = json.loads((engine_dir / "engine.json").read_text())
    if not spec.get("drafter_dir"):
        print(f"bench.speculative: {engine_dir} has no drafter (drafter.kind: redrafter, then make build)",
              file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    dev = resolve_device(serving.device)
    rows = measure(engine_dir, batches, args.tokens, args.repeats, serving, args.problems, args.threads, args.workload)
    offline_file = recipe.layout.drafter / "acceptance.json"
    offline = json.loads(offline_file.read_text()) if offline_file.is_file() else None
    offline_tps = offline.get("tokens_per_step") if offline else None
    wins = [r["batch"] for r in rows if r["mode"] == "recipe sampling" and r["speedup"] > 1.0]
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
        f"cpu ({args.threads or torch.get_num_threads()} threads)",
        "engine": str(engine_dir), "workload": args.workload, "tokens": args.tokens, "repeats": args.repeats,
        "draft_len": (spec.get("drafter") or {}).get("draft_len_per_beam"),
        "offline_tokens_per_step": offline_tps, "rows": rows,
        "largest_winning_batch": max(wins) if wins else 0,
        "default_max_batch": DEFAULT_MAX_BATCH.get(dev.type),
        "versions": {"torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"speculative decoding on {report['device']} ({args.workload} workload, {args.tokens} tokens, "
          f"median of {args.repeats}; "
          f"offline tokens/step {offline_tps})")
    shown = [{**r, "speedup_x": f"{r['speedup']:.2f}x",
              "vs_offline": r["tokens_per_step"] / offline_tps if offline_tps else None} for r in rows]
    print(format_table(shown, [("mode", "mode", ">15"), ("batch", "batch", ">5"),
                               ("with", "with_drafter_tok_s", ">9.1f"), ("without", "without_tok_s", ">9.1f"),
                               ("speedup", "speedup_x", ">8"), ("tok/step", "tokens_per_step", ">9.2f"),
                               ("vs offline", "vs_offline", ">10.2f")]))
    print(f"drafting wins up to batch {report['largest_winning_batch']} (of {batches}); the engine's default "
          f"switch-off for {dev.type}: above {report['default_max_batch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

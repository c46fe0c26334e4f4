"""What speculative decoding buys the embedded engine: tokens/s with and without the drafter, side by side.

    python -m server.bench.speculative --recipe engines/mix.yaml [--batches 1,4,8] [--tokens 128] \
        [--device auto] [--out bench/speculative.json]

The same engine folder is served twice per repeat, with its ReDrafter head (drafting at every batch
size, whatever the device's switch-off default) and without it; both get the same requests: the
shipped problems in the chat format, B at a time, under the recipe's sampling and greedily. Each
row gives the median generated tokens/s of both, their ratio, and the tokens per sequence per step
in serving next to the drafter stage's offline figure (`drafter/acceptance.json`). The largest batch
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
from typing import Any, Optional

from server.protocol import Final, Request, SamplingParams


def log(msg: str) -> None:
    print(f"[bench.speculative] {msg}", file=sys.stderr, flush=True)


def problem_prompts(engine: Any, problems_file: str, n: int) -> list[list[int]]:
    from server.problems import read_problems

    problems = read_problems(problems_file)
    texts = [problems[i % len(problems)].text for i in range(n)]
    return [engine.tokenize(engine.chat_prompt(t)) for t in texts]


def throughput(engine: Any, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[Final]]:
    async def one(p: list[int], sp: SamplingParams) -> Final:
        async for ev in engine.generate(Request(p, sp)):
            if isinstance(ev, Final):
                return ev
        raise RuntimeError("no final message")

    async def go() -> list[Final]:
        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    t0 = time.perf_counter()
    finals = asyncio.run(go())
    wall = time.perf_counter() - t0
    bad = [f for f in finals if f.finish_reason not in ("stop", "length")]
    if bad:
        raise RuntimeError(f"benchmark request ended with {bad[0].finish_reason}: {bad[0].error}")
    return sum(len(f.token_ids) for f in finals) / wall, finals


def open_engine(engine_dir: Path, speculative: bool, device: Optional[str]) -> Any:
    from server.embedded.engine import EmbeddedEngine

    kw: dict[str, Any] = {"speculative": "on" if speculative else "off"}
    if speculative:
        kw["speculative_max_batch"] = 10**6  # draft at every batch size: the switch-off is what we measure
    if device:
        kw["device"] = device
    return EmbeddedEngine.from_dir(engine_dir, **kw)


def measure(engine_dir: Path, batches: list[int], tokens: int, repeats: int, sampling: SamplingParams,
            problems: str, device: Optional[str]) -> list[dict[str, Any]]:
    modes = {"recipe sampling": sampling, "greedy": SamplingParams(temperature=0.0, max_tokens=tokens)}
    runs: dict[tuple[str, int, bool], list[float]] = {}
    spec_stats: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for speculative in (True, False):
            engine = open_engine(engine_dir, speculative, device)
            try:
                prompts = problem_prompts(engine, problems, max(batches))
                throughput(engine, prompts[:2], [SamplingParams(temperature=0.0, max_tokens=8)] * 2)  # warm-up
                for mode, base in modes.items():
                    for b in batches:
                        params = [SamplingParams(temperature=base.temperature, top_p=base.top_p, top_k=base.top_k,
                                                 max_tokens=tokens, seed=1000 * r + i) for i in range(b)]
                        s0 = (engine.stats.spec_rows, engine.stats.accepted_draft_tokens)
                        tps, _ = throughput(engine, prompts[:b], params)
                        runs.setdefault((mode, b, speculative), []).append(tps)
                        if speculative:
                            rows = engine.stats.spec_rows - s0[0]
                            acc = engine.stats.accepted_draft_tokens - s0[1]
                            spec_stats.setdefault((mode, b), []).append(1.0 + acc / rows if rows else 1.0)
                        log(f"repeat {r + 1}/{repeats} {mode:>15} batch {b:>2} "
                            f"{'with' if speculative else 'without'} drafter: {tps:.1f} tok/s")
            finally:
                engine.shutdown()
    out = []
    for mode in modes:
        for b in batches:
            on, off = statistics.median(runs[(mode, b, True)]), statistics.median(runs[(mode, b, False)])
            out.append({"mode": mode, "batch": b, "with_drafter_tok_s": round(on, 2), "without_tok_s": round(off, 2),
                        "speedup": round(on / off, 3),
                        "tokens_per_step": round(statistics.median(spec_stats[(mode, b)]), 3)})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.speculative", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="engines/mix.yaml")
    ap.add_argument("--engine", type=Path, default=None, help="engine folder (default: the recipe's build/embedded)")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None, help="auto | cpu | cuda[:N] (default: the engine folder's)")
    ap.add_argument("--problems", default="engines/problems/smoke.csv")
    ap.add_argument("--out", type=Path, default=Path("bench/speculative.json"))
    args = ap.parse_args(argv)

    import torch

    from server.embedded.engine import resolve_device
    from server.embedded.speculative import DEFAULT_MAX_BATCH
    from trtbuild.core.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    engine_dir = args.engine or recipe.layout.engine("embedded")
    spec = json.loads((engine_dir / "engine.json").read_text())
    if not spec.get("drafter_dir"):
        print(f"bench.speculative: {engine_dir} has no drafter (drafter.kind: redrafter, then make build)",
              file=sys.stderr)
        return 2
    s = recipe.serving.sampling
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=args.tokens)
    batches = [int(b) for b in args.batches.split(",")]
    dev = resolve_device(args.device or (spec.get("serving") or {}).get("device", "auto"))
    rows = measure(engine_dir, batches, args.tokens, args.repeats, sampling, args.problems, str(dev))
    offline_file = recipe.layout.drafter / "acceptance.json"
    offline = json.loads(offline_file.read_text()) if offline_file.is_file() else None
    offline_tps = offline.get("tokens_per_step") if offline else None
    wins = [r["batch"] for r in rows if r["mode"] == "recipe sampling" and r["speedup"] > 1.0]
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "engine": str(engine_dir), "tokens": args.tokens, "repeats": args.repeats,
        "draft_len": (spec.get("drafter") or {}).get("draft_len_per_beam"),
        "offline_tokens_per_step": offline_tps, "rows": rows,
        "largest_winning_batch": max(wins) if wins else 0,
        "default_max_batch": DEFAULT_MAX_BATCH.get(dev.type),
        "versions": {"torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"speculative decoding on {report['device']} ({args.tokens} tokens, median of {args.repeats}; "
          f"offline tokens/step {offline_tps})")
    print(f"{'mode':>15} {'batch':>5} {'with':>9} {'without':>9} {'speedup':>8} {'tok/step':>9} {'vs offline':>10}")
    for r in rows:
        rel = f"{r['tokens_per_step'] / offline_tps:.2f}" if offline_tps else "-"
        print(f"{r['mode']:>15} {r['batch']:>5} {r['with_drafter_tok_s']:>9.1f} {r['without_tok_s']:>9.1f} "
              f"{r['speedup']:>7.2f}x {r['tokens_per_step']:>9.2f} {rel:>10}")
    print(f"drafting wins up to batch {report['largest_winning_batch']} (of {batches}); the engine's default "
          f"switch-off for {dev.type}: above {report['default_max_batch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

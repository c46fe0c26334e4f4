"""Throughput of each weight format on the embedded runtime: bf16 (merged) vs int8 weight-only vs FP8.

    python -m server.bench.formats --recipe engines/mix.yaml --out bench/formats.json

Same load for each (8 concurrent requests of 48 tokens, end of sequence ignored, median of 3):
aggregate tokens/s and the ratio to bf16. On CPU, int8 weight-only runs torch's int8-weight GEMM and
FP8 is an exact emulation in bf16, so this measures this runtime, not what a GPU engine gains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from aimo_spec.protocol import Request, SamplingParams, collect
from server.tables import format_table


async def burst(engine, prompt: list[int], n: int, tokens: int) -> float:
    t = time.perf_counter()
    results = await asyncio.gather(*(collect(engine, Request(prompt, SamplingParams(temperature=0.7, seed=i,
                                                                                       max_tokens=tokens,
                                                                                       ignore_eos=True)))
                                     for i in range(n)))
    return sum(len(f.token_ids) for _, f in results) / (time.perf_counter() - t)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.formats", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from aimo_spec.recipe import load_recipe
    from server.embedded.engine import EmbeddedEngine

    recipe = load_recipe(args.recipe)
    dirs = {f: recipe.layout.weights(f) for f in ("bf16", *recipe.quantize.formats)}
    rows = []
    for name, d in dirs.items():
        if not (d / "config.json").is_file():
            print(f"[bench] {name}: not built ({d}); skipped", file=sys.stderr)
            continue
        eng = EmbeddedEngine.from_dir(d)
        try:
            prompt = eng.tokenize(eng.chat_prompt("What is the sum of the first 20 primes?"))
            asyncio.run(burst(eng, prompt, 2, 8))  # warm-up
            tps = statistics.median(asyncio.run(burst(eng, prompt, args.concurrent, args.tokens))
                                    for _ in range(args.repeats))
        finally:
            eng.shutdown()
        rows.append({"format": name, "tok_s": round(tps, 1)})
        print(f"[bench] {name}: {tps:.1f} tok/s at {args.concurrent} concurrent", file=sys.stderr)
    base = next((r["tok_s"] for r in rows if r["format"] == "bf16"), None)
    for r in rows:
        r["vs_bf16"] = round(r["tok_s"] / base, 3) if base else None
    print(f"embedded runtime, {args.concurrent} concurrent x {args.tokens} tokens, median of {args.repeats}")
    print(format_table(rows, [("format", "format", "<8"), ("tok/s", "tok_s", ">7"), ("vs bf16", "vs_bf16", ">8")]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"concurrent": args.concurrent, "tokens": args.tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

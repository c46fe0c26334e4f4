"""`make bench`'s last step: every benchmark's figures and ratios in one table, printed and written.

    python -m server.bench.report --dir bench   ->  bench/summary.md, bench/summary.json

Reads what the benchmarks of one `make bench` run wrote (sandbox.json, serving.json, triton.json,
openai.json, formats.json, llamacpp.json; gpu.json when `python -m server.bench.gpu` ran on a GPU host)
and lists each figure with the ratio it is about, so one file says what this machine does today.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional


def rows(d: Path) -> list[tuple[str, str, str, str]]:
    """(benchmark, measure, figure, ratio)."""
    out: list[tuple[str, str, str, str]] = []

    def load(name: str) -> Optional[Any]:
        p = d / name
        return json.loads(p.read_text()) if p.is_file() else None
    if (s := load("sandbox.json")):
        for name, v in s["latency"].items():
            out.append(("sandbox", f"cell latency, {name} (median)", f"{v['median_ms']:.2f} ms",
                        f"{v['vs_warm_pool']:.2f}x warm pool"))
    if (s := load("serving.json")):
        for r in s["throughput"]:
            out.append(("engine", f"in-flight, {r['concurrency']} concurrent", f"{r['in_flight_tok_s']:.1f} tok/s",
                        f"{r['in_flight_vs_sequential']:.2f}x sequential, {r['in_flight_vs_library']:.2f}x library CB"))
        h = s["harness"]
        out.append(("harness", "(client + scheduler) / forward", f"{100 * h['overhead_fraction']:.1f}%",
                    f"{100 * h['overhead_fraction_with_sampling']:.1f}% with sampling"))
        out.append(("harness", "solve run, whole-run throughput", f"{h['tokens_per_second']:.1f} tok/s", ""))
    if (s := load("triton.json")):
        out.append(("triton", "server startup (process start to ready)", f"{s['startup_seconds']:.1f} s", ""))
        for r in s["rows"]:
            out.append(("triton", f"{r['concurrent']} concurrent, through Triton", f"{r['triton_tok_s']:.1f} tok/s",
                        f"{r['throughput_ratio']:.2f}x direct; {r['latency_ratio']:.2f}x per-token latency"))
    if (s := load("openai.json")):
        out.append(("openai", "make serve startup (process start to ready)", f"{s['startup_seconds']:.1f} s", ""))
        for r in s["rows"]:
            out.append(("openai", f"{r['concurrent']} concurrent, through make serve", f"{r['http_tok_s']:.1f} tok/s",
                        f"{r['throughput_ratio']:.2f}x direct; {r['latency_ratio']:.2f}x per-token latency; TTFT "
                        f"{r['http_ttft_ms']:.0f} vs {r['direct_ttft_ms']:.0f} ms"))
    if (s := load("speculative.json")):
        for r in s["rows"]:
            out.append(("speculative", f"{s['device']}, {r['mode']}, batch {r['batch']}",
                        f"{r['with_drafter_tok_s']:.1f} tok/s", f"{r['speedup']:.2f}x without the drafter; "
                        f"{r['tokens_per_step']:.2f} tokens/step (offline {s['offline_tokens_per_step']})"))
    if (s := load("formats.json")):
        for r in s["rows"]:
            out.append(("formats", f"{r['format']}, {s['concurrent']} concurrent", f"{r['tok_s']:.1f} tok/s",
                        f"{r['vs_bf16']:.2f}x bf16" if r["vs_bf16"] else ""))
    if (s := load("llamacpp.json")):
        for r in s["rows"]:
            out.append(("llamacpp", f"{r['concurrent']} concurrent, engine on the llama.cpp runner ({s['gguf']})",
                        f"{r['engine_llamacpp_tok_s']:.1f} tok/s",
                        f"{r['engine_vs_python']:.2f}x llama-cpp-python; "
                        f"{r['engine_vs_batched']:.2f}x llama.cpp batched"))
    if (s := load("gpu.json")):  # python -m server.bench.gpu --out bench/gpu.json
        for r in s["rows"]:
            if "engine_tok_s" not in r:  # a configuration that failed: its row names the error
                continue
            out.append(("gpu", f"{s['meta']['gpu']} {r['shape']} {r['format']} kv {r['kv_cache']}, batch {r['batch']}, "
                               f"context {r['context']}", f"{r['engine_tok_s']:.1f} tok/s",
                        f"{100 * r['engine_fraction_of_bound']:.1f}% of the bandwidth bound "
                        f"({r['bound_tok_s']:.0f} tok/s)"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("bench"))
    args = ap.parse_args(argv)
    table = rows(args.dir)
    if not table:
        print(f"bench_report: no benchmark results in {args.dir}", file=sys.stderr)
        return 2
    md = [f"# make bench, {time.strftime('%Y-%m-%d')}", "", "| benchmark | measure | figure | ratio |",
          "|---|---|---|---|"]
    md += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table]
    (args.dir / "summary.md").write_text("\n".join(md) + "\n")
    (args.dir / "summary.json").write_text(json.dumps([dict(zip(("benchmark", "measure", "figure", "ratio"), r))
                                                       for r in table], indent=2))
    w = max(len(b) for _, b, _, _ in table)
    for a, b, c, d in table:
        print(f"{a:<9} {b:<{w}} {c:>14}  {d}")
    print(f"-> {args.dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make eval MODEL=mix DATA=problems.csv`: k samples per problem for several variants, side by side.

    python -m server.programs.evaluate --recipe engines/mix.yaml --data engines/problems/smoke.csv --k 8 \
        --variants cot,tir,merged,int8_wo,fp8

Writes `eval.json`, `report.md` and the plots to --out (default runs/<model>/eval); what they hold, and
`--tool-settings`: server/evaluate.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from server.evaluate import (
    budget_curve,
    markdown,
    parse_tool_settings,
    plots,
    run_variant,
    summarize,
    variant_dirs,
    with_tool_setting,
)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--variants", default="", help="comma list (default: every source, merged, each quantized format)")
    ap.add_argument("--seconds", type=float, default=120.0, help="deadline per problem and variant")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each sample's tokens (default: the recipe's)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tool-settings", default="", help="run each variant under these named tool settings, side by "
                                                         "side: NAME=stateful|stateless/CHARS/SECONDS[,...]")
    ap.add_argument("--url", default="", help="evaluate what OpenAI-compatible server(s) serve (comma-separated "
                                             "replicas; one variant, 'served') instead of the recipe's variants")
    args = ap.parse_args(argv)
    import os
    import platform

    from aimo_spec.recipe import RecipeError, load_recipe
    from server.assembly import sandbox_for
    from server.embedded.engine import EmbeddedEngine
    from server.embedded.settings import serving_settings
    from server.problems import log, read_problems

    try:
        recipe = load_recipe(args.recipe)
        serving = serving_settings(recipe)
        problems = read_problems(args.data)
        settings = parse_tool_settings(args.tool_settings)
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
    if args.max_tokens:
        import dataclasses

        serving = dataclasses.replace(serving,
                                      sampling=dataclasses.replace(serving.sampling, max_tokens=args.max_tokens))
    dirs = variant_dirs(recipe) if not args.url else {"served": Path(args.url)}
    names = [v for v in args.variants.split(",") if v] or list(dirs) if not args.url else ["served"]
    missing = [n for n in names if n not in dirs or not args.url and not (dirs[n] / "config.json").is_file()]
    if missing:
        print(f"eval: variants {missing} not built or unknown (known: {', '.join(dirs)}); run `make engine` first",
              file=sys.stderr)
        return 2
    out = args.out or Path("runs") / recipe.name / "eval"
    out.mkdir(parents=True, exist_ok=True)
    t = serving.tool
    if settings:
        import dataclasses

        t = dataclasses.replace(t, wall_seconds=max(s[2] for s in settings.values()))
    runs = [(name, "", serving) for name in names] if not settings else [
        (name, f"@{label}", with_tool_setting(serving, setting))
        for name in names for label, setting in settings.items()]
    report: dict[str, Any] = {"recipe": str(args.recipe), "data": str(args.data), "k": args.k,
                              "max_tokens": serving.sampling.max_tokens, "seconds_per_problem": args.seconds,
                              "problems": len(problems), "date": time.strftime("%Y-%m-%d"),
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "variants": {},
                              "tool_settings": {k: {"stateful": v[0], "output_chars": v[1], "seconds": v[2]}
                                                for k, v in settings.items()}}
    with sandbox_for(t) as pool:
        for name, suffix, run_serving in runs:
            log(f"[eval] {name}{suffix}: {dirs[name]} (stateful {run_serving.tool.stateful}, "
                f"{run_serving.output_chars} characters, {run_serving.tool.wall_seconds} s per call)")
            if args.url:
                from server.backends import open_for_recipe

                try:
                    engine = open_for_recipe(recipe, "openai", url=args.url)
                except (FileNotFoundError, ConnectionError, ValueError) as e:
                    print(f"eval: {e}", file=sys.stderr)
                    return 2
            else:
                engine = EmbeddedEngine.from_dir(dirs[name], serving=serving)
            try:
                t0 = time.monotonic()
                results = asyncio.run(run_variant(engine, pool, run_serving, problems, args.k, args.seconds, log))
            finally:
                engine.shutdown()
            report["variants"][name + suffix] = {"dir": args.url or str(dirs[name]), "results": results,
                                                 "summary": summarize(results, args.k),
                                                 "seconds": round(time.monotonic() - t0, 1)}
            stats = getattr(engine, "stats", None)
            spec = stats.speculative() if stats is not None and hasattr(stats, "speculative") else None
            if spec:
                report["variants"][name + suffix]["speculative"] = spec
                log(f"[eval] {name}{suffix}: speculative decoding {spec['tokens_per_step']:.2f} tokens per step, "
                    f"{100 * spec['acceptance']:.0f}% of drafts accepted")
            s = report["variants"][name + suffix]["summary"]
            log(f"[eval] {name}{suffix}: maj@{args.k} {s['maj_at_k'][str(args.k)]:.3f}, pass@{args.k} "
                f"{s['pass_at_k'][str(args.k)]:.3f}, {s['reply_tokens_mean']} tokens, "
                f"{s['code_calls_per_solution']} code calls per solution")
    finishes = sorted(s["finished_at"] for v in report["variants"].values() for r in v["results"] for s in r["samples"])
    top = finishes[-1] if finishes else 1.0
    report["budget_grid"] = [round(top * i / 20, 2) for i in range(1, 21)]
    for v in report["variants"].values():
        v["budget_curve"] = budget_curve(v["results"], report["budget_grid"])
    files = plots(report, out)
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    md = markdown(report, files)
    (out / "report.md").write_text(md)
    print(md)
    log(f"[eval] wrote {out}/eval.json, report.md, {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

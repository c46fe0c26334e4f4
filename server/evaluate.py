"""`make eval MODEL=mix DATA=problems.csv`: k samples per problem for several variants, side by side.

Run by server/programs/evaluate.py.

Every variant (a source, the merged bf16 model, each quantized export) answers every problem with k
samples run to completion (no early stop), through the real embedded engine, TIR client and sandbox.
The report gives maj@k and pass@k for k = 1..K, computed exactly over all k-subsets; mean reply
length; code calls per solution; tool error and timeout rates; the no-answer rate; and a table of
tool-error kinds (NameError by name, ImportError by module, timeouts, output cut), so preimports and
limits are set from data. It writes `eval.json` (every sample with its entropies, for
`server.replay`), `report.md`, and plots: accuracy vs k, accuracy vs wall-clock seconds per
problem, reply-length distributions.

`--tool-settings before=stateless/200/5,after=stateful/1000/10` runs every variant under each named
tool setting (session kind / output characters fed back / seconds per call), side by side as
`<variant>@<setting>` columns: how the harness defaults are chosen from measurement.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from server.metrics import accuracy_at_budget, maj_at_k, pass_at_k
from server.toolerrors import error_table


def variant_dirs(recipe: Any) -> dict[str, Path]:
    """Every model the recipe builds that the embedded engine can serve, by name."""
    layout = recipe.layout
    out = {name: recipe.source_model(name) for name in recipe.sources}
    out["merged"] = layout.merged
    for fmt in recipe.quantize.formats:
        out[fmt] = layout.quantized(fmt)
    return out


def sample_record(t: Any, t0: float) -> dict[str, Any]:
    statuses = [c.status for c in t.code_calls]
    return {"answer": t.answer, "tokens": t.tokens, "finish": t.finish, "seconds": round(t.seconds, 3),
            "finished_at": round(t.started - t0 + t.seconds, 3), "code_calls": len(statuses),
            "tool_errors": sum(s in ("error", "killed") for s in statuses),
            "tool_timeouts": sum(s == "timeout" for s in statuses),
            "error_kinds": [c.error for c in t.code_calls if c.error],
            "output_cut": sum(c.cut for c in t.code_calls), "tool_seconds": round(t.tool_seconds, 3),
            "mean_entropy": t.mean_entropy, "local_entropy": t.local_entropy}


def parse_tool_settings(text: str) -> dict[str, tuple[bool, int, float]]:
    """'before=stateless/200/5,after=stateful/1000/10' -> {name: (stateful, output_chars, seconds)}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, spec = item.partition("=")
        parts = spec.split("/")
        try:
            if not name or len(parts) != 3 or parts[0] not in ("stateful", "stateless"):
                raise ValueError
            out[name] = (parts[0] == "stateful", int(parts[1]), float(parts[2]))
        except ValueError:
            raise ValueError(f"--tool-settings: {item!r} is not NAME=stateful|stateless/CHARS/SECONDS") from None
        if out[name][1] < 1 or out[name][2] <= 0:
            raise ValueError(f"--tool-settings: {item!r}: characters must be >= 1 and seconds > 0")
    return out


def with_tool_setting(serving: Any, setting: tuple[bool, int, float]) -> Any:
    """`serving` with the tool setting (stateful, output_chars, seconds per call)."""
    import dataclasses

    stateful, chars, seconds = setting
    return dataclasses.replace(serving, output_chars=chars,
                               tool=dataclasses.replace(serving.tool, stateful=stateful, wall_seconds=seconds))


async def run_variant(engine: Any, sandbox: Any, serving: Any, problems: list, k: int, seconds: float,
                      log: Any) -> list[dict[str, Any]]:
    from server.assembly import build_solver
    from server.problems import tools_note

    solver = build_solver(serving, engine, sandbox, k, all_samples=True, logprobs=True)
    out = []
    for i, p in enumerate(problems, start=1):
        t0 = time.monotonic()
        r = await solver.solve(p.id, p.text, time.monotonic() + seconds, p.answer)
        # samples whose code calls the sandbox lost measure the sandbox, not the model: a problem that
        # lost its tools was retried (server.solver); its first k sound samples are the ones scored
        ordered = sorted(r.traces, key=lambda t: t.sample)
        sound = [t for t in ordered if not t.tool_faults] + [t for t in ordered if t.tool_faults]
        out.append({"id": p.id, "truth": p.answer, "seconds": round(r.seconds, 2),
                    "samples": [sample_record(t, t0) for t in sound[:k]],
                    "tool_faults": r.tool_faults, "tools_lost": tools_note(r) if r.tool_failure else None})
        log(f"  [{i}/{len(problems)}] {p.id}: answers {[s['answer'] for s in out[-1]['samples']]} (truth {p.answer})"
            + (f"; LOST ITS TOOLS: {out[-1]['tools_lost']}" if r.tool_failure else ""))
    return out


def summarize(results: list[dict[str, Any]], k: int) -> dict[str, Any]:
    scored = [r for r in results if r["truth"] is not None]
    samples = [s for r in results for s in r["samples"]]
    calls = sum(s["code_calls"] for s in samples)
    ks = list(range(1, k + 1))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0
    return {
        "problems": len(results), "samples": len(samples),
        "maj_at_k": {str(j): round(mean([maj_at_k([s["answer"] for s in r["samples"]], r["truth"], j)
                                         for r in scored if len(r["samples"]) >= j]), 4) for j in ks},
        "pass_at_k": {str(j): round(mean([pass_at_k([s["answer"] for s in r["samples"]], r["truth"], j)
                                          for r in scored if len(r["samples"]) >= j]), 4) for j in ks},
        "reply_tokens_mean": round(mean([s["tokens"] for s in samples]), 1),
        "reply_tokens_median": statistics.median([s["tokens"] for s in samples]) if samples else 0,
        "code_calls_per_solution": round(calls / max(1, len(samples)), 3),
        "tool_error_rate": round(sum(s["tool_errors"] for s in samples) / max(1, calls), 4),
        "tool_timeout_rate": round(sum(s["tool_timeouts"] for s in samples) / max(1, calls), 4),
        "output_cut_rate": round(sum(s.get("output_cut", 0) for s in samples) / max(1, calls), 4),
        "code_calls": calls,
        # error kinds, and "output cut" for calls whose output was cut to the cap (a limit to set from data too)
        "tool_error_kinds": error_table([k for s in samples for k in s.get("error_kinds", [])]
                                        + ["output cut"] * sum(s.get("output_cut", 0) for s in samples), calls),
        "no_answer_rate": round(sum(s["answer"] is None for s in samples) / max(1, len(samples)), 4),
        "seconds_per_problem": round(mean([r["seconds"] for r in results]), 2),
        "tool_faults": sum(r.get("tool_faults", 0) for r in results),
        "tools_lost": {r["id"]: r["tools_lost"] for r in results if r.get("tools_lost")},
    }


def budget_curve(results: list[dict[str, Any]], grid: list[float]) -> list[float]:
    scored = [r for r in results if r["truth"] is not None]
    return [sum(accuracy_at_budget([(s["answer"], s["finished_at"]) for s in r["samples"]], r["truth"], g)
                for r in scored) / max(1, len(scored)) for g in grid]


def plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["variants"])
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        m = report["variants"][n]["summary"]["maj_at_k"]
        ax.plot([int(j) for j in m], list(m.values()), marker="o", label=n)
    ax.set_xlabel("k (samples per problem)"), ax.set_ylabel("maj@k"), ax.set_title("Accuracy vs k"), ax.legend()
    fig.tight_layout(), fig.savefig(out / "accuracy_vs_k.png", dpi=110), plt.close(fig)
    files.append("accuracy_vs_k.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        c = report["variants"][n]["budget_curve"]
        ax.plot(report["budget_grid"], c, label=n)
    (ax.set_xlabel("seconds per problem (all samples launched together)"),
     ax.set_ylabel("accuracy (majority of finished)"))
    ax.set_title("Accuracy vs wall-clock budget"), ax.legend()
    fig.tight_layout(), fig.savefig(out / "accuracy_vs_budget.png", dpi=110), plt.close(fig)
    files.append("accuracy_vs_budget.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist([[s["tokens"] for r in report["variants"][n]["results"] for s in r["samples"]] for n in names],
            bins=20, label=names)
    ax.set_xlabel("reply length (model tokens)"), ax.set_ylabel("samples"), ax.set_title("Reply lengths"), ax.legend()
    fig.tight_layout(), fig.savefig(out / "lengths.png", dpi=110), plt.close(fig)
    files.append("lengths.png")
    return files


def markdown(report: dict[str, Any], files: list[str]) -> str:
    k = report["k"]
    names = list(report["variants"])
    s = {n: report["variants"][n]["summary"] for n in names}
    lines = [f"# Evaluation: {report['recipe']} on {report['data']} ({report['problems']} problems, k = {k}, "
             f"at most {report.get('max_tokens')} tokens per sample)", "",
             "| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for j in sorted({1, (k + 1) // 2, k}):
        lines.append(f"| maj@{j} | " + " | ".join(f"{s[n]['maj_at_k'][str(j)]:.3f}" for n in names) + " |")
    for j in sorted({1, k}):
        lines.append(f"| pass@{j} | " + " | ".join(f"{s[n]['pass_at_k'][str(j)]:.3f}" for n in names) + " |")
    for key, label in (("reply_tokens_mean", "mean reply tokens"), ("code_calls_per_solution", "code calls / solution"),
                       ("tool_error_rate", "tool error rate"), ("tool_timeout_rate", "tool timeout rate"),
                       ("output_cut_rate", "output cut rate"),
                       ("no_answer_rate", "no-answer rate"), ("seconds_per_problem", "seconds / problem (k samples)")):
        lines.append(f"| {label} | " + " | ".join(f"{s[n].get(key, '')}" for n in names) + " |")
    lines += ["", *tool_error_lines(s, names)]
    lost = [(n, pid, why) for n in names for pid, why in s[n].get("tools_lost", {}).items()]
    if lost:
        lines += ["", "Problems that lost their tools (code calls lost by the sandbox itself, not the code's errors; "
                  "samples with a lost call are scored only when too few others remain):", ""]
        lines += [f"- {n}: {pid}: {why}" for n, pid, why in lost]
    lines += ["", f"Generated {report['date']} on {report['machine']}; maj@k and pass@k are exact over all k-subsets "
              "(ties go to the answer of the lowest-numbered sample, as the solver's vote).", ""]
    lines += [f"![{f}]({f})" for f in files]
    return "\n".join(lines) + "\n"


def tool_error_lines(summaries: dict[str, dict[str, Any]], names: list[str], top: int = 15) -> list[str]:
    """The tool-error table: per kind, count (share of code calls) per column; the most frequent first."""
    totals: dict[str, int] = {}
    for n in names:
        for kind, count, _ in summaries[n].get("tool_error_kinds", []):
            totals[kind] = totals.get(kind, 0) + count
    if not totals:
        return ["No tool errors ("
                + ", ".join(f"{n}: {summaries[n].get('code_calls', 0)} code calls" for n in names) + ")."]
    lines = ["Tool errors by kind, count (share of code calls):", "",
             "| kind | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind in sorted(totals, key=lambda k: (-totals[k], k))[:top]:
        cells = []
        for n in names:
            row = next((r for r in summaries[n].get("tool_error_kinds", []) if r[0] == kind), None)
            cells.append(f"{row[1]} ({row[2]:.1%})" if row else "0")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| code calls | " + " | ".join(str(summaries[n].get("code_calls", 0)) for n in names) + " |")
    return lines

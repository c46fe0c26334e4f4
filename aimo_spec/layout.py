"""Where things live under `engines/<model>/`: one object instead of path joins spread over the code.

    engines/<model>/
      sources/<name>/model/      each source as an HF checkpoint (hf sources are used in place)
      merge/model/               the merged checkpoint
      quantize/<fmt>/{hf,trtllm}/  ModelOpt exports: unified HF checkpoint, TensorRT-LLM checkpoint
      quantize/gguf_<type>/gguf/   llama.cpp's export: model.gguf + tokenizer files
      drafter/model/             the ReDrafter head (TensorRT-LLM converter layout)
      build/<backend>/           an engine folder: engine.json + model/ (+ engine/ TensorRT plans)
      trtllm/                    TensorRT-LLM work folders (checkpoint, calibration, redrafter)
      triton/, kaggle/           deployments made from an engine folder

Each stage folder holds a `manifest.json` once the stage has finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

ENGINE_FILE = "engine.json"  # what a runtime reads to serve an engine folder
GGUF_FILE = "model.gguf"  # a model folder holding it (with its tokenizer) is served by llama.cpp
GGUF_PREFIX = "gguf_"  # quantization formats made by llama.cpp's converter (gguf_q8_0), not by ModelOpt


def is_gguf(quantization: str) -> bool:
    """A format whose weights are a GGUF folder (llama.cpp serves it; TensorRT-LLM cannot)."""
    return quantization.startswith(GGUF_PREFIX)


@dataclass(frozen=True)
class Layout:
    root: Path  # engines/<model>/

    # ---- stage folders (each has a manifest.json when done)
    @property
    def sources(self) -> Path:
        return self.root / "sources"

    def source(self, name: str) -> Path:
        if not name or name in (".", "..") or Path(name).name != name:  # the recipe check refuses these first
            raise ValueError(f"a source's name must be one folder name (got {name!r})")
        return self.sources / name

    def source_model(self, name: str) -> Path:
        return self.source(name) / "model"

    @property
    def merge(self) -> Path:
        return self.root / "merge"

    @property
    def merged(self) -> Path:
        """The merged HF checkpoint (the bf16 weights every later stage starts from)."""
        return self.merge / "model"

    @property
    def quantize(self) -> Path:
        return self.root / "quantize"

    def quantize_format(self, fmt: str) -> Path:
        return self.quantize / fmt

    def quantized(self, fmt: str) -> Path:
        """What the embedded runtime serves of one format: the unified HF export, or for a gguf_*
        format the GGUF folder (model.gguf + tokenizer)."""
        return self.quantize_format(fmt) / ("gguf" if is_gguf(fmt) else "hf")

    def quantized_trtllm(self, fmt: str) -> Path:
        """The TensorRT-LLM checkpoint export of one format."""
        return self.quantize_format(fmt) / "trtllm"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def drafter_model(self) -> Path:
        return self.drafter / "model"

    @property
    def build(self) -> Path:
        return self.root / "build"

    def engine(self, backend: str) -> Path:
        """An engine folder: what one backend serves (`engine.json` + `model/`)."""
        return self.build / backend

    def engine_file(self, backend: str) -> Path:
        return self.engine(backend) / ENGINE_FILE

    def has_engine(self, backend: str) -> bool:
        return self.engine_file(backend).is_file()

    # ---- work and deployment folders
    @property
    def trtllm_work(self) -> Path:
        return self.root / "trtllm"

    @property
    def triton(self) -> Path:
        return self.root / "triton"

    @property
    def kaggle(self) -> Path:
        return self.root / "kaggle"

    def weights(self, quantization: str) -> Path:
        """The weights of a `build.quantization` value: the merged model for bf16, else its export (an HF
        checkpoint, or a GGUF folder for gguf_* formats)."""
        return self.merged if quantization == "bf16" else self.quantized(quantization)

    # ---- what the stages write
    def work_folders(self, written_sources: Iterable[str], formats: Iterable[str]) -> list[Path]:
        """The folders the stages make and replace, outermost first (`written_sources`: the sources the
        sources stage writes; an hf source is used where it is)."""
        return [self.root, self.sources, *(self.source(n) for n in written_sources), self.merge, self.quantize,
                *(self.quantize_format(f) for f in formats), self.drafter, self.build, self.engine("embedded"),
                self.engine("trtllm"), self.trtllm_work, self.triton, self.kaggle]

    def in_the_way(self, written_sources: Iterable[str], formats: Iterable[str]) -> list[Path]:
        """Work folders that exist as something else (a file, a link to one, a dangling link): a stage failed
        on one midway with a traceback; a run names them before it starts."""
        return [p for p in self.work_folders(written_sources, formats)
                if (p.exists() or p.is_symlink()) and not p.is_dir()]

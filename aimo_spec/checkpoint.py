"""A checkpoint folder's safetensors tensors by name, read from disk one at a time.

What a stage compares against when the weights are still on disk (the merge's exactness check, the
quantized export's rounding check): reading a tensor when it is asked for keeps one tensor in memory,
not a second copy of the model (a 14B's would be 30 GB of host RAM). safetensors loads inside the
methods: the core imports with numpy and pyyaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping


class CheckpointTensors(Mapping[str, Any]):
    """name -> tensor (torch, as stored) across the `*.safetensors` shards of `folder`."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files: dict[str, Path] = {}
        for f in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as s:
                self.files.update(dict.fromkeys(s.keys(), f))
        if not self.files:
            raise FileNotFoundError(f"{self.folder}: no *.safetensors files")

    def __getitem__(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{name} is not in the checkpoint at {self.folder}")
        with safe_open(str(self.files[name]), framework="pt") as s:
            return s.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self.files  # Mapping's would read the tensor to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

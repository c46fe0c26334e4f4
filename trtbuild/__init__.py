"""Build pipeline: recipe -> sources -> merge -> quantize -> engine (embedded or TensorRT-LLM).

Importing this package needs only numpy and pyyaml; stages import torch, mergekit, ModelOpt or
TensorRT-LLM lazily, where they are used.
"""

__version__ = "0.1.0"

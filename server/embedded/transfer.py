"""Host-to-device copies of a step's small inputs that do not wait for the device.

A blocking copy to a GPU (`torch.tensor(values, device="cuda")`, `.to("cuda")`) synchronizes its
stream: the host then waits for every kernel queued before it, which would undo the engine's
overlap of host work with the step in flight (steps.py). Going through pinned memory with
`non_blocking=True` queues the copy behind that work instead; PyTorch keeps the pinned block alive
until the copy has run.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list) as a tensor on `device`, without synchronizing a CUDA stream."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst := src (a CPU tensor, or one on dst's device) without synchronizing a CUDA stream: a
    captured graph's static inputs are filled this way."""
    if dst.is_cuda and not src.is_cuda:
        src = src.contiguous().pin_memory()
    dst.copy_(src, non_blocking=True)

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


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a tensor on `device`, without synchronizing a CUDA stream."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

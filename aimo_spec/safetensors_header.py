"""A safetensors file's header, read and checked without reading a tensor.

The format: 8 bytes of little-endian header length, the JSON header (tensor name -> dtype, shape,
data_offsets into the data that follows; an optional `__metadata__`), the data. The pipeline counts a
source's parameters from its headers before any stage runs, the sources stage refuses a checkpoint
whose headers are not whole, and an engine folder is checked before it is served: all from here, so a
truncated copy, a garbage file or a header length of 2^64 gets one message naming the file, never an
OverflowError or a KeyError from deep inside a library. Standard library only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20  # safetensors' own reader refuses larger headers


class SafetensorsError(ValueError):
    """The file is not a whole safetensors file; the message names it and what is wrong."""


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """(tensor name -> its entry, without `__metadata__`; the header's length in bytes). Every entry has a
    dtype, a shape of counts and data offsets inside the file's data."""
    if not path.is_file():  # a FIFO or a device would block the read, a folder fail obscurely
        raise SafetensorsError(f"{path}: not a regular file")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: truncated or corrupt safetensors header (header {n} bytes, file {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (a {type(header).__name__}, not a mapping)")
    data = size - 8 - n
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                and all(_is_count(d) for d in t["shape"]) and isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{path}: tensor {name[:200]!r}: not a safetensors entry (a dtype, a shape of "
                                   f"counts, data_offsets [start, end]) (got {str(t)[:200]})")
        if offsets[1] > data:
            raise SafetensorsError(f"{path}: tensor {name[:200]!r} ends at byte {offsets[1]} of the data, but the "
                                   f"file holds {data} (truncated or corrupt copy)")
        tensors[name] = t
    return tensors, n


def check_whole(path: Path) -> dict[str, dict[str, Any]]:
    """`read_header`, and the tensors' data ends exactly at the file's end (a truncated copy fails)."""
    tensors, n = read_header(path)
    expected = 8 + n + max((t["data_offsets"][1] for t in tensors.values()), default=0)
    size = path.stat().st_size
    if expected != size:
        raise SafetensorsError(f"{path}: {size} bytes but its header describes {expected} (truncated or corrupt copy)")
    return tensors


def parameters(tensors: dict[str, dict[str, Any]]) -> int:
    """Elements over all tensors of a header."""
    total = 0
    for t in tensors.values():
        count = 1
        for d in t["shape"]:
            count *= d
        total += count
    return total

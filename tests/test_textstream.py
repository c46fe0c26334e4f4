"""The incremental detokenizer and the stop matcher (server/textstream.py) on a byte-level toy tokenizer."""

from __future__ import annotations

import random

from server.textstream import MAX_HELD_TOKENS, IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Token i is the byte i, except ids >= 256: whole strings (TABLE), as a byte-level BPE vocabulary."""

    TABLE = {256: "\ufffd", 257: " ok"}

    def decode(self, ids, skip_special_tokens=True):
        out = bytearray()
        for i in ids:
            out += self.TABLE[i].encode() if i in self.TABLE else bytes([i])
        return out.decode("utf-8", errors="replace")


def test_a_character_split_over_tokens_is_held_until_complete():
    d = IncrementalDetokenizer(ByteTokenizer())
    first, second = "é".encode()
    assert d.push([ord("a")]) == "a"
    assert d.push([first]) == ""
    assert d.push([second]) == "é"
    assert d.flush() == ""


def test_text_ending_in_a_real_replacement_character_is_let_out_after_a_bounded_hold():
    """A model may emit U+FFFD itself: the text streams (at most MAX_HELD_TOKENS behind), not all held to the end."""
    d = IncrementalDetokenizer(ByteTokenizer())
    streamed = "".join(d.push([256]) for _ in range(200))
    assert len(streamed) >= 200 - MAX_HELD_TOKENS and set(streamed) == {"\ufffd"}
    assert streamed + d.flush() == "\ufffd" * 200


def test_held_suffix_is_the_longest_suffix_that_starts_a_stop_string():
    """Against the plain definition, on random stops and texts of a small alphabet (many partial overlaps)."""
    def longest(stops, text):
        return max([n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])],
                   default=0)

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 10)))
        assert StopMatcher(stops)._held_suffix(text) == longest(stops, text), (stops, text)


def test_streamed_text_is_the_whole_decode_for_any_push_sizes():
    """Engines push several tokens at once (a speculative step's accepted run, a remote server's chunk): for
    random text (multi-byte characters, real U+FFFD) cut into random pushes, the streamed pieces plus the flush
    are the whole text, and no piece carries a U+FFFD the text does not have at that place."""
    rng = random.Random(1)
    alphabet = ["a", " ", "é", "中", "字", "😀", "\ufffd"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = [i for c in text for i in ([256] if c == "\ufffd" else c.encode())]
        d = IncrementalDetokenizer(ByteTokenizer())
        out, i = "", 0
        while i < len(ids):
            n = rng.randint(1, 12)
            piece = d.push(ids[i:i + n])
            assert text.startswith(out + piece), (text, out, piece)
            out += piece
            i += n
        assert out + d.flush() == text

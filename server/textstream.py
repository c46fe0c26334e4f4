"""Token ids -> text, incrementally, and stop strings matched on that text (used by `server.stream`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

# A UTF-8 character has at most 4 bytes, each token at least one: text ending in U+FFFD after this many held
# tokens is the character itself (models emit it), not a partial one, and is let out (held, it would stay back
# to the end and the window re-decoded each step would grow without bound)
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Decodes a growing id list without re-decoding it all each step.

    Byte-level BPE tokens can end inside a UTF-8 character; such text is held back until the
    character is complete. A small window of earlier tokens is re-decoded for context, so tokenizers
    whose pieces depend on their left neighbour (leading-space handling) decode the same as a whole.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text was already returned

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") and len(self.ids) - self._read < MAX_HELD_TOKENS:
            return ""  # an incomplete character: wait for the next token
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (a dangling partial character decodes as U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        self._prefix = self._read = len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Emits text as soon as it cannot be the start of a stop string; reports the first match.

    `feed` returns (text safe to emit, matched stop string or None, overhang). After a match,
    the emitted text ends exactly with the stop string and `overhang` is the rest of the text fed.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: Optional[str] = None

    def feed(self, text: str) -> tuple[str, Optional[str], str]:
        if self.matched is not None:
            return "", self.matched, text
        pending = self._pending + text
        best: Optional[tuple[int, str]] = None
        for s in self.stops:
            i = pending.find(s)
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), s)
        if best is not None:
            end, s = best
            self.matched, self._pending = s, ""
            return pending[:end], s, pending[end:]
        hold = self._held_suffix(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[: len(pending) - hold], None, ""

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        if not text:
            return 0
        last = text[-1]
        for s in self.stops:
            n = min(len(s) - 1, len(text))
            while n > longest:  # only where the prefix ends in text's last character: no slice per length
                n = s.rfind(last, 0, n) + 1
                if n > longest and text.endswith(s[:n]):
                    longest = n
                    break
                n -= 1
        return longest

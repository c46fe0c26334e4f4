"""Token ids -> text, incrementally, and stop strings matched on that text (used by `server.stream`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

# Text that ends in U+FFFD is held: a token can end inside a UTF-8 character. Models also emit U+FFFD itself, and
# held to the end, the text would stay back and the window re-decoded each step grow without bound. Past this many
# held tokens, all but the last PARTIAL_TOKENS (a partial character has at most 3 bytes, each token at least one)
# are let out, up to a cut that splits no character.
MAX_HELD_TOKENS = 8
PARTIAL_TOKENS = 3


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
        end = len(self.ids)
        if after.endswith("\ufffd"):  # an incomplete character, or U+FFFD itself
            if end - self._read <= MAX_HELD_TOKENS:
                return ""  # wait for the next token
            end = self._boundary(after)
            if end is None:
                return ""
            after = decode(self.ids[self._prefix:end], skip_special_tokens=True)
        self._prefix, self._read = self._read, end
        return after[len(before):]

    def _boundary(self, text: str) -> Optional[int]:
        """The latest cut, at least PARTIAL_TOKENS before the end, after which the held tokens' text continues
        `text` exactly (a cut inside a character decodes to U+FFFD where `text` has the character); None if
        none. Everything before it is let out; the last tokens, which may hold a partial character, wait."""
        for j in range(len(self.ids) - PARTIAL_TOKENS, self._read, -1):
            if text.startswith(self.tokenizer.decode(self.ids[self._prefix:j], skip_special_tokens=True)):
                return j
        return None

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

"""Which requests run, in which slot, from which reused prefix: the embedded engine's scheduler.

It owns the queue of waiting requests and the slots, and touches the runner only to move KV between
slots (`copy`, `swap`); the engine asks it, each iteration, which requests have expired, which to
admit next, and which batch the decode step runs, and tells it when a request ends.

Slots: running sequences occupy slots 0..len(running)-1 in admission order (the runners decode slots
[0, n)); a finished one swaps with the last running slot so they stay packed. The rest are parked:
their KV is kept for reuse, with its tokens and when it was last used.

Prefix reuse: a new request starts from the longest common token prefix found in any slot: a parked
one is taken over (the next turn of a TIR sample continues from its own history without re-reading
it), a running one is copied (samples of one problem share the prompt's prefill); otherwise it evicts
the least recently used parked slot. `Final.cached_tokens` says how many prompt tokens were reused.
Only requests with the same `Request.cache_salt` share KV: a request's first-token time and cached_tokens
would otherwise tell its client whether anyone else's prompt began the same way (the empty salt is one
shared tenant).
In deterministic mode only whole aligned prefill chunks are reused (server/embedded/deterministic.py).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from typing import Any, Optional

import server.embedded.deterministic as deterministic
from server.embedded.sequence import Seq


class Scheduler:
    """Waiting requests, slots and kept prefixes; its calls are the engine thread's, one at a time."""

    def __init__(self, runner: Any, max_batch_size: int, max_seq_len: int, max_input_len: int,
                 prefix_reuse: bool = True, deterministic: bool = False, vocab_size: Optional[int] = None):
        self.runner = runner
        self.vocab_size = vocab_size  # prompt ids past it would index past the embedding table
        self.max_batch_size, self.max_seq_len, self.max_input_len = max_batch_size, max_seq_len, max_input_len
        self.prefix_reuse, self.deterministic = prefix_reuse, deterministic
        # by the Seq's identity, in arrival order: a cancelled request leaves in O(1) (a client that drops
        # a request of thousands of choices cancels every one of them)
        self.waiting: OrderedDict[int, Seq] = OrderedDict()
        self.running: list[Seq] = []  # running[i].slot == i
        self.parked: dict[int, tuple[list[int], float, str]] = {}  # slot -> (tokens with KV, last use, salt)
        self.by_id: dict[str, Seq] = {}  # every request not yet finished, waiting or running
        # (deadline, arrival, seq) of requests with one, soonest first: each iteration's expiry check costs
        # what has expired, not a walk over every request in flight (a queue may hold thousands)
        self._deadlines: list[tuple[float, int, Seq]] = []
        self._arrivals = itertools.count()

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def in_flight(self) -> list[Seq]:
        """Running then waiting requests (a snapshot: ending one while walking it is safe)."""
        return self.running + list(self.waiting.values())

    def add(self, seq: Seq) -> None:
        self.by_id[seq.req.request_id] = seq
        self.waiting[id(seq)] = seq
        if seq.req.deadline is not None:
            heapq.heappush(self._deadlines, (seq.req.deadline, next(self._arrivals), seq))

    def get(self, request_id: str) -> Optional[Seq]:
        return self.by_id.get(request_id)

    def expired(self) -> list[Seq]:
        """Requests in flight whose deadline has passed."""
        now, out = time.monotonic(), []
        while self._deadlines and self._deadlines[0][0] <= now:
            seq = heapq.heappop(self._deadlines)[2]
            if self.by_id.get(seq.req.request_id) is seq:  # not ended meanwhile
                out.append(seq)
        return out

    def batch(self) -> list[Seq]:
        """What the next decode step runs: every running sequence, in slot order (empty when none has
        a sampled token to decode)."""
        if not any(s.pending is not None for s in self.running):
            return []
        assert all(s.slot == i for i, s in enumerate(self.running))
        return list(self.running)

    def admit_next(self) -> Optional[tuple[Seq, str]]:
        """The first waiting request while a slot is free, or None. Returned with '' once it runs in slot
        len(running) with `kv_len` positions of its prompt already there (reused); with the reason when
        its prompt cannot run at all (the caller ends it). The caller may prefill admitted requests
        together, after asking again, as long as `waits_on` says the next one reuses none of their
        prompts; a prefill may end its request, which frees its slot for the next."""
        if not self.waiting or len(self.running) >= self.max_batch_size:
            return None
        _, seq = self.waiting.popitem(last=False)
        n = len(seq.prompt)
        if n == 0 or n > self.max_input_len:
            return seq, f"prompt of {n} tokens: must be 1..{self.max_input_len} (max_input_len)"
        if self.vocab_size and not (0 <= min(seq.prompt) and max(seq.prompt) < self.vocab_size):
            # refused here, not in the prefill: a bad id there fails the whole batch (on a GPU, the device)
            bad = next(t for t in seq.prompt if not 0 <= t < self.vocab_size)
            return seq, f"prompt token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})"
        seq.max_new = min(seq.params.max_tokens, self.max_seq_len - n)
        if seq.max_new < 1:
            return seq, f"prompt of {n} tokens leaves no room below max_seq_len {self.max_seq_len}"
        slot = len(self.running)
        best, best_len = self._longest_prefix(seq.prompt, slot, seq.req.cache_salt)
        if best >= slot:  # a parked slot: take it over
            self._move_parked(best, slot)
        else:  # evict the least recently used parked slot; copy a running one's prefix in
            victim = min(range(slot, self.max_batch_size), key=lambda s: self.parked.get(s, ([], -1.0, ""))[1])
            self._move_parked(victim, slot)
            if best >= 0:
                self.runner.copy(best, slot, best_len)
        self.parked.pop(slot, None)
        seq.slot, seq.kv_len = slot, best_len
        seq.stream.cached_tokens, seq.stream.scheduled = best_len, time.monotonic()
        self.running.append(seq)
        return seq, ""

    def waits_on(self, admitted: list[Seq]) -> bool:
        """Whether the next waiting request would reuse more of its prompt once `admitted` (running,
        their prompts not computed yet) are prefilled: their slots hold only the KV they reused so far,
        so the caller prefills them before asking `admit_next` again (the samples of a problem: the
        first computes the prompt, the rest copy it)."""
        if not (self.waiting and admitted and self.prefix_reuse) or len(self.running) >= self.max_batch_size:
            return False
        nxt = next(iter(self.waiting.values()))
        prompt, salt = nxt.prompt, nxt.req.cache_salt
        have = self._longest_prefix(prompt, len(self.running), salt)[1]
        for seq in admitted:
            if seq.req.cache_salt != salt:
                continue
            i = _common_prefix(seq.prompt, prompt, min(len(seq.prompt), len(prompt) - 1))
            if (deterministic.whole_chunks(i) if self.deterministic else i) > have:
                return True
        return False

    def finish(self, seq: Seq) -> bool:
        """Forget a request (its slot parked with the KV it leaves); False when it had already ended."""
        if self.by_id.pop(seq.req.request_id, None) is None:
            return False
        self.waiting.pop(id(seq), None)
        if len(self._deadlines) > 2 * len(self.by_id) + 64:  # ended requests' entries: drop them (amortised)
            self._deadlines = [e for e in self._deadlines if self.by_id.get(e[2].req.request_id) is e[2]]
            heapq.heapify(self._deadlines)
        if 0 <= seq.slot < len(self.running) and self.running[seq.slot] is seq:
            i, last = seq.slot, len(self.running) - 1
            if i != last:
                other = self.running[last]
                self.runner.swap(i, last, max(seq.kv_len, other.kv_len))
                self.running[i], other.slot = other, i
            self.running.pop()
            kept = seq.canonical if self.deterministic else seq.kv_len
            self.parked[last] = (seq.tokens[:kept], time.monotonic(), seq.req.cache_salt)
        return True

    def drop_all(self) -> list[Seq]:
        """Forget every request and every kept prefix without touching the cache (its state is unknown
        after a failed step), so the next requests start clean; returns those that had not ended."""
        live = [s for s in self.in_flight() if self.by_id.pop(s.req.request_id, None) is not None]
        self.running, self.waiting, self._deadlines = [], OrderedDict(), []
        self.parked.clear()
        return live

    def _slot_tokens(self, slot: int, salt: str) -> list[int]:
        """The tokens whose KV a new request with cache salt `salt` may reuse from `slot` (none where the slot
        holds another salt's; deterministic mode: canonical KV only)."""
        if slot < len(self.running):
            s = self.running[slot]
            return s.tokens[:s.canonical if self.deterministic else s.kv_len] if s.req.cache_salt == salt else []
        toks, _, owner = self.parked.get(slot, ([], 0.0, salt))
        return toks if owner == salt else []

    def _longest_prefix(self, prompt: list[int], slot: int, salt: str) -> tuple[int, int]:
        """(slot, length) of the longest prefix of `prompt` that a request with cache salt `salt` may reuse,
        (-1, 0) when none; on a tie a parked slot (at or past `slot`) wins over a running one, since taking
        it over costs no copy."""
        best, best_len = -1, 0
        if not self.prefix_reuse:
            return best, best_len
        for s in range(self.max_batch_size):
            toks = self._slot_tokens(s, salt)
            i = _common_prefix(toks, prompt, min(len(toks), len(prompt) - 1))  # one token left to compute:
            if self.deterministic:  # its logits start the reply
                i = deterministic.whole_chunks(i)
            if i > best_len or (i == best_len and i > 0 and s >= slot and best < slot):
                best, best_len = s, i
        return best, best_len

    def _move_parked(self, src: int, dst: int) -> None:
        """Exchange two parked (or free) slots, data and bookkeeping."""
        if src == dst:
            return
        a, b = self.parked.pop(src, None), self.parked.pop(dst, None)
        self.runner.swap(src, dst, max(len(a[0]) if a else 0, len(b[0]) if b else 0))
        if a:
            self.parked[dst] = a
        if b:
            self.parked[src] = b


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit` (whole-slice comparison first: prompts of
    one problem share thousands)."""
    if limit <= 0:
        return 0
    if a[:limit] == b[:limit]:
        return limit
    i = 0
    while a[i] == b[i]:
        i += 1
    return i

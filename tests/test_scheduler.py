"""The embedded engine's scheduler on its own: the queue of waiting requests.

The runner is a test double that records slot moves (the scheduler touches the runner only to copy and
swap KV between slots); requests are real `Seq`s over real streams.
"""

from __future__ import annotations

import asyncio

import torch

from aimo_spec.protocol import Request, SamplingParams
from server.embedded.scheduler import Scheduler
from server.embedded.sequence import Seq
from server.stream import RequestStream


class SlotMoves:
    def __init__(self) -> None:
        self.moves: list[tuple] = []

    def copy(self, *args) -> None:
        self.moves.append(("copy", *args))

    def swap(self, *args) -> None:
        self.moves.append(("swap", *args))


def make_seqs(n: int, prompt: list[int]) -> list[Seq]:
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=4, seed=1)
        return [Seq(RequestStream(Request(tuple(prompt), params, f"r{i}"), list(prompt), None, loop),
                    torch.Generator(), 1) for i in range(n)]
    finally:
        loop.close()


def test_requests_alike_in_every_field_are_still_two_requests():
    """A Seq is one request: equal fields (same prompt, same settings) do not make two of them equal, so
    ending one never takes another's place in the queue."""
    a, b = make_seqs(2, [1, 2, 3])
    b.stream, b.gen = a.stream, a.gen  # every field the same
    assert a != b and a == a
    sched = Scheduler(SlotMoves(), max_batch_size=1, max_seq_len=64, max_input_len=32)
    sched.add(a)
    sched.add(b)
    assert sched.finish(b)
    left = list(sched.waiting.values())
    assert len(left) == 1 and left[0] is a


def test_cancelled_waiting_requests_leave_the_queue_and_the_rest_keep_their_order():
    seqs = make_seqs(2000, [7, 8])
    sched = Scheduler(SlotMoves(), max_batch_size=2, max_seq_len=64, max_input_len=32)
    for s in seqs:
        sched.add(s)
    for s in seqs[::2]:  # a client that drops half of its choices
        assert sched.finish(s)
    assert not any(sched.finish(s) for s in seqs[::2])  # ending twice is a no-op
    assert [s.req.request_id for s in sched.in_flight()] == [s.req.request_id for s in seqs[1::2]]
    first, why = sched.admit_next()
    assert first is seqs[1] and why == "" and first.slot == 0
    assert len(sched.waiting) == 999 and sched.in_flight()[0] is seqs[1]
    assert sched.drop_all() and sched.idle and not sched.by_id


def test_only_requests_past_their_deadline_expire_and_ended_ones_are_forgotten():
    import time

    seqs = make_seqs(300, [4, 5])
    now = time.monotonic()
    for i, s in enumerate(seqs):  # every third has a deadline: two of those three past, one far ahead
        s.stream.request.deadline = None if i % 3 else (now - 1 if i % 2 == 0 else now + 3600)
    sched = Scheduler(SlotMoves(), max_batch_size=2, max_seq_len=64, max_input_len=32)
    for s in seqs:
        sched.add(s)
    past = [s for s in seqs if s.req.deadline is not None and s.req.deadline < now]
    sched.finish(past[0])  # ended before the check: not reported
    assert sched.expired() == past[1:] and sched.expired() == []
    for s in seqs:
        sched.finish(s)
    assert len(sched._deadlines) <= 64  # the far-ahead entries of ended requests do not pile up

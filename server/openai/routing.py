"""Which replica serves a request: the one that served the longest prefix of its prompt (the next turn
of a TIR sample returns to the KV its server kept), else the least loaded one that is up.

Its own module because this memory of token histories (hashed prefixes, bounded, oldest out) is
separate from how a request is sent and how a replica fails.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional, Sequence

from server.openai.replicas import Replica

AFFINITY_ENTRIES = 4096  # token histories remembered for routing continuations back to their replica
_HASH_MOD, _HASH_BASE = (1 << 61) - 1, 1_000_003


def prefix_hashes(ids: Sequence[int]) -> list[int]:
    """h[i] = hash of ids[:i] (polynomial, so every prefix costs one step)."""
    out, h = [0], 0
    for t in ids:
        h = (h * _HASH_BASE + int(t) + 1) % _HASH_MOD
        out.append(h)
    return out


class Router:
    """Picks replicas from `replicas` (the engine's list, shared) and remembers who served what."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        self._affinity: OrderedDict[tuple[int, int], Replica] = OrderedDict()
        self._lengths: dict[int, int] = {}  # history length -> entries of that length in _affinity

    def pick(self, hashes: Optional[list[int]], exclude: set[int]) -> Optional[Replica]:
        """The replica for a prompt of these prefix hashes (None: no routing by prefix), none of
        `exclude` (ids of replicas already tried); None when every replica was tried."""
        cands = [r for r in self.replicas if id(r) not in exclude]
        if not cands:
            return None
        now = time.monotonic()
        if hashes is not None:
            n = len(hashes) - 1
            for length in sorted(self._lengths, reverse=True):
                if length <= n:
                    rep = self._affinity.get((length, hashes[length]))
                    if rep is not None and id(rep) not in exclude and rep.up(now):
                        return rep
        up = [r for r in cands if r.up(now)] or [min(cands, key=lambda r: r.down_until)]
        return min(up, key=lambda r: (r.in_flight, r.served))

    def remember(self, tokens: Sequence[int], rep: Replica) -> None:
        """`rep` served this token history: a prompt that continues it goes back there."""
        key = (len(tokens), prefix_hashes(tokens)[-1])
        if key in self._affinity:
            self._affinity.move_to_end(key)
        else:
            self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
        self._affinity[key] = rep
        while len(self._affinity) > AFFINITY_ENTRIES:
            (length, _), _ = self._affinity.popitem(last=False)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

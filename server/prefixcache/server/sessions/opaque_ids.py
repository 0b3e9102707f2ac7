"""Opaque ids: node handles and lock ids that name one thing and reveal nothing.

Ids that were a per-start base plus a counter would let a tenant that holds one guess
its neighbours (47 Lock probes find 20 of 20 of another tenant's live nodes). So each id
is a keyed pseudo-random permutation of its counter (the process-wide node id, or the
registry's lock counter):

* **unique**: a permutation maps distinct counters to distinct ids, with no table to
  keep and nothing to collide;
* **unguessable**: without the key, drawn per start, an id says nothing about the ids
  of other nodes or locks; a guess names a live one with odds of (live ids) / 2**62;
* **checkable**: the inverse maps an id back to its counter, so the registry can tell
  "never issued" from "no longer held" without remembering every id it gave out;
* **per start**: a new start draws a new key, so an id from before a restart names
  nothing now (rather than somebody else's node or lock).

The permutation is a four-round Feistel network on 62 bits (two 31-bit halves) with
keyed BLAKE2b as the round function (Luby-Rackoff: four rounds of a pseudo-random
function make a strong pseudo-random permutation, one an attacker cannot tell from
random even with an inverse oracle, which "is this id valid" almost is). Ids are
``1 + perm(counter)``: never 0 (which means "none" on the wire), and below 2**63, so
they fit a signed 64-bit integer as well as the proto's uint64.
"""

from __future__ import annotations

import hashlib
import secrets

_HALF = 31
_MASK = (1 << _HALF) - 1
DOMAIN = 1 << (2 * _HALF)  # counters and ids (less one) are below this
_ROUNDS = 4


class OpaqueIds:
    """One keyed permutation per kind of id (nodes, locks), drawn per start.

    Args:
        key: 32 bytes of secret (None: drawn from ``secrets``); fixed only in tests.
    """

    __slots__ = ("_keys",)

    def __init__(self, key: bytes | None = None) -> None:
        key = secrets.token_bytes(32) if key is None else key
        # One round key per (kind, round), so node handles and lock ids are unrelated.
        self._keys = {
            kind: [
                hashlib.blake2b(bytes([kind, r]), key=key, digest_size=32).digest()
                for r in range(_ROUNDS)
            ]
            for kind in (0, 1)
        }

    def node(self, counter: int) -> int:
        """The handle of the node with this (process-wide) id."""
        return 1 + _permute(self._keys[0], counter)

    def lock(self, counter: int) -> int:
        """The id of the registry's ``counter``-th lock."""
        return 1 + _permute(self._keys[1], counter)

    def lock_counter(self, lock_id: int) -> int:
        """The counter ``lock_id`` was made from (-1: not an id this start could make)."""
        if not 1 <= lock_id <= DOMAIN:
            return -1
        return _unpermute(self._keys[1], lock_id - 1)


def _round(key: bytes, half: int) -> int:
    digest = hashlib.blake2b(half.to_bytes(4, "little"), key=key, digest_size=4).digest()
    return int.from_bytes(digest, "little") & _MASK


def _permute(keys: list[bytes], x: int) -> int:
    if not 0 <= x < DOMAIN:
        raise ValueError(f"counter {x} is outside the id space")
    left, right = x >> _HALF, x & _MASK
    for key in keys:
        left, right = right, left ^ _round(key, right)
    return (left << _HALF) | right


def _unpermute(keys: list[bytes], y: int) -> int:
    left, right = y >> _HALF, y & _MASK
    for key in reversed(keys):
        left, right = right ^ _round(key, left), left
    return (left << _HALF) | right

"""Seals over a tree's KV in the pool: what a warm restart checks before it serves a page.

A snapshot or checkpoint holds the tree (tree_snapshot.py); the KV stays in the pool
files, where anything that maps them can write (a worker of the old run, a stray
process; tmpfs does not even move a file's mtime for writes through a mapping). So
each snapshot carries a seal (page_seal.PageSeal, XXH3-128, no key) per *unit*: a run
of whole pages of one node, about ``UNIT_BYTES`` of KV (at least one page). The seal
covers the unit's identity (the model's fingerprint, its namespace), its slots, its
tokens and every byte of its rows in every K and V buffer, so bytes moved to other
slots, other tokens over the same bytes, or any changed byte fail it.

A start checks every unit before it serves anything (a full pass over the used part
of the pool; rows are hashed in place where a unit's slots are one run, gathered
first where not), and a unit that fails is cut off with everything below it in the
tree (tree_snapshot.prune): a shorter hit, never a wrong one.

Sealing is incremental: a node's slots and bytes do not change while it is in the
tree, so a unit's seal, once made, is kept by (node id, first slot, length) and reused
by every later checkpoint until the node leaves the tree or is split (its units then
differ). A checkpoint seals only what entered the tree since the one before, and only
units of nodes still in the tree when it seals them (``seal_some`` runs in slices).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from prefixcache.cache.key import TOKEN_BYTES
from prefixcache.cache.radix.tree_snapshot import TreeImage, TreeParts

from .page_seal import SEAL_BYTES, PageSeal, identity

# About this much KV per seal: per-unit costs (a few microseconds) stay small next to
# hashing the bytes (~30 us per MiB), and a failure cuts off at most this much more
# than the page that changed.
UNIT_BYTES = 1 << 20
_SEALER = PageSeal()

Key = tuple[int, int, int]  # (node id, first slot, tokens)


def kv_rows(engine: Any) -> list[np.ndarray]:
    """Every K and V buffer of ``engine``'s KV pool as a (rows, bytes) uint8 view."""
    kv = engine.kv_pool
    out = []
    for buf in [*kv.k_buffer, *kv.v_buffer]:
        flat = buf.detach().reshape(buf.shape[0], -1).view(torch.uint8)
        out.append(flat.numpy())
    return out


def unit_tokens(page_size: int, rows: list[np.ndarray]) -> int:
    """Tokens per unit for a pool whose rows are ``rows``: whole pages, about
    ``UNIT_BYTES`` of KV."""
    row_bytes = max(1, sum(r.shape[1] for r in rows))
    return max(1, UNIT_BYTES // (row_bytes * page_size)) * page_size


def _units(length: int, per_unit: int) -> Iterator[tuple[int, int]]:
    """(offset, tokens) of each unit of a node of ``length`` tokens."""
    for offset in range(0, length, per_unit):
        yield offset, min(per_unit, length - offset)


class TreeSeals:
    """One model's seals: the identity its units are sealed under, its pool's rows, and
    the seals made so far (kept across checkpoints, see the module docstring)."""

    def __init__(self, fingerprint: dict[str, Any], rows: list[np.ndarray], page_size: int) -> None:
        self._base = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).digest()
        self.rows = rows
        self.row_bytes = sum(r.shape[1] for r in rows)
        self.per_unit = unit_tokens(page_size, rows)
        self._kept: dict[Key, bytes] = {}
        self.sealed_bytes = 0  # KV bytes hashed to make seals, in all

    def _ident(self, namespace: tuple[str | None, int]) -> bytes:
        return identity("prefixcache/warm-seal/v1", self._base, namespace[0], namespace[1])

    def _parts(self, slots: np.ndarray, key: memoryview) -> Iterator[Any]:
        yield np.ascontiguousarray(slots, dtype="<i8").data.cast("B")
        yield key
        lo, hi = int(slots[0]), int(slots[-1]) + 1
        one_run = hi - lo == slots.size and bool((np.diff(slots) == 1).all())
        for rows in self.rows:
            yield rows[lo:hi].data if one_run else np.ascontiguousarray(rows[slots]).data

    # --------------------------------------------------------------- checkpoints

    def plan(self, tree: TreeParts) -> list[tuple[int, int, int, Key]]:
        """Every unit of ``tree``: (node index, offset, tokens, key)."""
        out = []
        ids = tree.node_ids.tolist()
        for i, (slots, length) in enumerate(zip(tree.slots, tree.key_lens.tolist(), strict=True)):
            for offset, n in _units(length, self.per_unit):
                out.append((i, offset, n, (ids[i], int(slots[offset]), n)))
        return out

    def missing(self, plan: list[tuple[int, int, int, Key]]) -> list[int]:
        """Indices into ``plan`` of the units with no seal yet."""
        kept = self._kept
        return [u for u, unit in enumerate(plan) if unit[3] not in kept]

    def seal_some(
        self,
        tree: TreeParts,
        plan: list[tuple[int, int, int, Key]],
        todo: list[int],
        seconds: float,
    ) -> list[int]:
        """Seal units of ``todo`` for about ``seconds``; returns those left. A unit
        whose node left the tree meanwhile is not sealed (its slots may hold other KV
        by now): the caller drops that node (``dropped``)."""
        deadline = time.perf_counter() + seconds
        while todo:
            i, offset, n, key = plan[todo.pop()]
            node = tree.nodes[i]
            if not node.evicted:
                width = tree.namespaces[int(tree.namespace[i])][1]
                tb = width * TOKEN_BYTES
                slots = tree.slots[i][offset : offset + n]
                token_bytes = memoryview(tree.keys[i])[offset * tb : (offset + n) * tb]
                self._kept[key] = _SEALER.seal(
                    self._ident(tree.namespaces[int(tree.namespace[i])]),
                    self._parts(slots, token_bytes),
                )
                self.sealed_bytes += n * self.row_bytes
            if time.perf_counter() > deadline:
                break
        return todo

    def dropped(self, plan: list[tuple[int, int, int, Key]]) -> list[int]:
        """Nodes of ``plan`` with a unit that has no seal (their node left the tree
        before it was sealed)."""
        kept = self._kept
        return sorted({i for i, _, _, key in plan if key not in kept})

    def seals(self, plan: list[tuple[int, int, int, Key]]) -> bytes:
        """The seals of ``plan``'s units end to end (each sealed before), and forget
        the seals no longer asked for (their nodes left the tree or were split)."""
        keys = [key for _, _, _, key in plan]
        kept = {key: self._kept[key] for key in keys}
        self._kept = kept
        return b"".join(kept[key] for key in keys)

    # ------------------------------------------------------------------ starts

    def verify(
        self, image: TreeImage, per_unit: int, seals: memoryview
    ) -> tuple[np.ndarray, list[bytes], int]:
        """Check every unit of ``image`` (sealed ``per_unit`` tokens a unit) against
        ``seals``: the tokens of each node to keep (up to its first failed unit; none
        below a node cut short), the seals kept, in order, and the units that failed.

        Raises:
            ValueError: ``seals`` is not one seal per unit.
        """
        lens = image.key_lens.tolist()
        count = sum((n + per_unit - 1) // per_unit for n in lens)
        if len(seals) != count * SEAL_BYTES:
            raise ValueError(f"{len(seals)} bytes of seals for {count} units")
        keys = memoryview(image.keys).cast("B")
        key_end, slot_end = image.key_ends().tolist(), image.slot_ends().tolist()
        parents = image.parent.tolist()
        keep = list(lens)
        good: list[bytes] = []
        failed = unit = 0
        for i, length in enumerate(lens):
            ns = image.namespaces[int(image.namespace[i])]
            tb = ns[1] * TOKEN_BYTES
            slot0, key0 = slot_end[i] - length, key_end[i] - length * tb
            up = parents[i]
            units = list(_units(length, per_unit))
            if up >= 0 and keep[up] != lens[up]:  # below a node cut short (or gone)
                keep[i] = 0
                unit += len(units)
                continue
            ident = self._ident(ns)
            for offset, n in units:
                seal = bytes(seals[unit * SEAL_BYTES : (unit + 1) * SEAL_BYTES])
                unit += 1
                if keep[i] != length:
                    continue
                slots = image.slots[slot0 + offset : slot0 + offset + n]
                token_bytes = keys[key0 + offset * tb : key0 + (offset + n) * tb]
                if _SEALER.check(ident, self._parts(slots, token_bytes), seal):
                    good.append(seal)
                else:
                    failed += 1
                    keep[i] = offset
        return np.asarray(keep, dtype=np.int64), good, failed

    def adopt(self, image: TreeImage, node_ids: list[int], seals: list[bytes]) -> None:
        """The seals a start checked, kept under its restored nodes' ids (``image`` is
        the pruned one the nodes were built from, ``node_ids`` theirs in order)."""
        kept: dict[Key, bytes] = {}
        it = iter(seals)
        slot_end = image.slot_ends().tolist()
        for i, length in enumerate(image.key_lens.tolist()):
            slot0 = slot_end[i] - length
            for offset, n in _units(length, self.per_unit):
                kept[(node_ids[i], int(image.slots[slot0 + offset]), n)] = next(it)
        self._kept = kept

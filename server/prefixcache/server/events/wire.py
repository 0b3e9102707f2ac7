"""The KV-event wire format: change-log records as the events vLLM and SGLang publish.

A batch is the msgpack array ``[ts, events, data_parallel_rank]`` (rank 0: a sidecar
models no ranks). Events, in the order of the engines' structs (vLLM
``vllm/distributed/kv_events.py``, SGLang ``srt/disaggregation/kv_events.py``):

* ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name``. One event per change-log record (one tree node's pages, root
  first); ``token_ids`` are those pages' tokens, ``block_size`` the page size,
  ``parent_block_hash`` nil at the root.
* ``BlockRemoved``: ``block_hashes, medium``.
* ``AllBlocksCleared``: no fields.

Encoding ``map`` (vLLM since #42892, SGLang since #37482): each event a map tagged
with ``"type"``, every field above present (nil when unset), none of the defaulted ones
(``extra_keys``, ``group_idx``, ...). Encoding ``array`` (older consumers, llm-d's SGLang
adapter): ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``.

Namespaces. ``lora_name`` is the namespace's ``extra_key`` (nil for the default one)
and ``lora_id`` is always nil (vLLM deprecated it; SGLang's is an adapter's int id,
which we do not have). llm-d and Dynamo fold ``lora_name`` into the keys they compute
from ``token_ids``, so two namespaces never share keys there. The key never goes into
``extra_keys``, which llm-d reads as multimodal hashes.

Tenants (``kv_events.tenants``, for servers with ``server.tenants``): ``hashed`` publishes
every ``BlockStored`` with ``token_ids`` empty (``[]``) and ``lora_name`` a keyed hash of
the namespace, ``"h:"`` and the first 32 hex digits of ``HMAC-SHA256(key,
b"prefixcache-kv-events-ns-v1\0" + K)`` (nil stays nil), and every namespace's chain,
the default one's too, seeded with ``HMAC-SHA256(key, b"prefixcache-kv-events-seed-v1\0"
+ width as uint32 little-endian + (b"\0" for no extra_key, else b"\1" + K))``. The key is
``kv_events.hash_key_file``'s bytes, else a random one drawn at start. Without the key a
subscriber can neither confirm a guessed namespace name nor a guessed prompt; a router
that computes hashes from a request's tokens is given the file (docs/across-nodes.md).
Block sizes and the links between parents, children and removals are unchanged, so a
router that only follows ``block_hashes`` sees the same tree. ``all`` publishes
everything, unkeyed.

Hashes are 64 bits of a SHA-256 page chain, the same chain in stored, removed and
parent fields:

* The chain is SGLang's (``hash_token_ids``: SHA-256 over the previous page's digest
  and the page's tokens as uint32 little-endian), which our tree keeps byte for byte.
  The default namespace (no ``extra_key``, width 1) is published as the tree has it,
  exactly what SGLang publishes for the same tokens. Any other namespace is chained
  from a seed, so equal tokens in two namespaces never share a hash on the wire: an
  ``extra_key`` K (width 1) is seeded as SGLang seeds a request salted with K,
  ``SHA256(b"sglang-cache-salt-v1\\0" + K)``; a wider token (bigram/EAGLE keys) from a
  prefixcache-specific seed over its width and key.
* ``sglang`` format: the digest's first 8 bytes as a signed int64 (``hash_to_int64``).
* ``vllm`` format: the digest's last 8 bytes as an unsigned int (msgpack uint64), the
  shape vLLM publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (its default). The
  chain is ours, not vLLM's ``H((parent or NONE_HASH, tokens, extra_keys))``: vLLM's
  values cannot be reproduced outside the engine (``NONE_HASH`` is random per process
  unless ``PYTHONHASHSEED`` is set, ``H`` is pickle/CBOR SHA-256 or xxhash by a flag,
  and ``extra_keys`` hold request data we never see), and every consumer of vLLM's
  events treats these values as opaque, deployment-stable ids that link parents and
  removals; they derive their own keys from ``token_ids``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import msgpack
import numpy as np

from prefixcache.cache.index.change_log import (
    AllCleared,
    Change,
    PagesRemoved,
    PagesStored,
    Snapshot,
)

SALT_DOMAIN = b"sglang-cache-salt-v1\0"
WIDTH_DOMAIN = b"prefixcache-namespace-v1\0"
HIDDEN_NS_DOMAIN = b"prefixcache-kv-events-ns-v1\0"
KEYED_SEED_DOMAIN = b"prefixcache-kv-events-seed-v1\0"
DATA_PARALLEL_RANK = 0

Namespace = tuple[str | None, int]


def namespace_seed(extra_key: str | None, token_width: int) -> bytes | None:
    """The digest a namespace's chain starts from (None: unseeded, the default one)."""
    if token_width == 1:
        if extra_key is None:
            return None
        return hashlib.sha256(SALT_DOMAIN + extra_key.encode("utf-8")).digest()
    key = b"\0" if extra_key is None else b"\1" + extra_key.encode("utf-8")
    return hashlib.sha256(WIDTH_DOMAIN + token_width.to_bytes(4, "little") + key).digest()


def keyed_seed(key: bytes, extra_key: str | None, token_width: int) -> bytes:
    """The digest a namespace's chain starts from under a hash key (every namespace)."""
    name = b"\0" if extra_key is None else b"\1" + extra_key.encode("utf-8")
    return hmac.digest(key, KEYED_SEED_DOMAIN + token_width.to_bytes(4, "little") + name, "sha256")


def hidden_namespace(extra_key: str | None, key: bytes) -> str | None:
    """The ``lora_name`` published for a namespace under ``kv_events.tenants: hashed``."""
    if extra_key is None:
        return None
    digest = hmac.digest(key, HIDDEN_NS_DOMAIN + extra_key.encode("utf-8"), "sha256")
    return "h:" + digest.hex()[:32]


def wire_hashes(hex_hashes: list[str], hash_format: str) -> list[int]:
    """64 bits of each hex page digest as the chosen engine publishes them."""
    # One vectorised pass: a page costs ~50 ns here against ~500 ns per int(h, 16).
    words = np.frombuffer(
        bytes.fromhex("".join(hex_hashes)), dtype=">i8" if hash_format == "sglang" else ">u8"
    ).reshape(-1, 4)
    # sglang: the first 8 bytes, signed; vllm: the last 8 bytes, unsigned.
    return words[:, 0 if hash_format == "sglang" else 3].tolist()


class WireChains:
    """The published digest of each page, from our tree's page hashes.

    Without a key the default namespace's digests are the tree's own. Seeded namespaces
    (with a key: every one) are re-chained page by page from their seed; their digests
    are kept per page while it is cached, so a child finds its parent's and a removal
    finds what was published.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self._seeded: dict[tuple[Namespace, str], bytes] = {}

    def _unseeded(self, rec: PagesStored | PagesRemoved) -> bool:
        return self.key is None and rec.extra_key is None and rec.token_width == 1

    def _seed(self, extra_key: str | None, token_width: int) -> bytes | None:
        if self.key is not None:
            return keyed_seed(self.key, extra_key, token_width)
        return namespace_seed(extra_key, token_width)

    def clear(self) -> None:
        self._seeded.clear()

    def stored(self, rec: PagesStored) -> tuple[list[str], str | None]:
        """The pages' published digests (hex) and the parent's (None at the root).

        Raises:
            KeyError: the parent page was never stored here (a gap in what we were fed).
        """
        if self._unseeded(rec):
            return list(rec.page_hashes), rec.parent_hash
        ns = rec.namespace
        parent = None if rec.parent_hash is None else self._seeded[(ns, rec.parent_hash)]
        prior = self._seed(rec.extra_key, rec.token_width) if parent is None else parent
        digests = []
        sha256 = hashlib.sha256
        for page_hash, page in rec.pages():
            prior = sha256(prior + page).digest()
            self._seeded[(ns, page_hash)] = prior
            digests.append(prior.hex())
        return digests, None if parent is None else parent.hex()

    def removed(self, rec: PagesRemoved) -> list[str]:
        if self._unseeded(rec):
            return list(rec.page_hashes)
        ns = rec.namespace
        return [self._seeded.pop((ns, h)).hex() for h in rec.page_hashes]


class EventEncoder:
    """Turns change-log records into events and events into batch payloads.

    Args:
        hash_format: ``"vllm"`` or ``"sglang"``.
        encoding: ``"map"`` or ``"array"``.
        medium: ``"GPU"`` or ``"CPU"``, where the model's pool lives.
        hide_key: publish no token ids, and namespace names and chains keyed with
            this (``hashed``); None: publish them.
    """

    def __init__(
        self, hash_format: str, encoding: str, medium: str, *, hide_key: bytes | None = None
    ) -> None:
        if hash_format not in ("vllm", "sglang") or encoding not in ("map", "array"):
            raise ValueError(f"unknown hash_format {hash_format!r} or encoding {encoding!r}")
        self.hash_format = hash_format
        self.encoding = encoding
        self.medium = medium
        self.hide_key = hide_key
        self.chains = self.fresh_chains()

    def fresh_chains(self) -> WireChains:
        """Chains that start over, keyed as this encoder's."""
        return WireChains(self.hide_key)

    def event(self, change: Change) -> Any:
        """The event for one record (tracking seeded chains as it goes)."""
        if isinstance(change, PagesStored):
            return self._stored(change, self.chains)
        if isinstance(change, PagesRemoved):
            hashes = wire_hashes(self.chains.removed(change), self.hash_format)
            if self.encoding == "array":
                return ["BlockRemoved", hashes, self.medium]
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": self.medium}
        if isinstance(change, AllCleared):
            self.chains.clear()
            return self.all_cleared()
        raise TypeError(f"not a change-log record: {change!r}")

    def all_cleared(self) -> Any:
        return ["AllBlocksCleared"] if self.encoding == "array" else {"type": "AllBlocksCleared"}

    def snapshot_events(self, snapshot: Snapshot, *, restart: bool) -> list[Any]:
        """``AllBlocksCleared`` then a ``BlockStored`` per node, parents first.

        With ``restart`` the encoder's chains start over from the snapshot (the live
        stream continues after it); otherwise they are left alone (a replay answer).
        """
        chains = self.fresh_chains()
        events = [self.all_cleared()]
        events.extend(self._stored(rec, chains) for rec in snapshot.pages)
        if restart:
            self.chains = chains
        return events

    def batch(self, events: list[Any], ts: float | None = None) -> bytes:
        """The msgpack payload ``[ts, events, data_parallel_rank]``."""
        return msgpack.packb(
            [time.time() if ts is None else ts, events, DATA_PARALLEL_RANK], use_bin_type=True
        )

    @staticmethod
    def pack_event(event: Any) -> bytes:
        """One event packed alone, for ``batch_of_packed`` (a batch built in slices)."""
        return msgpack.packb(event, use_bin_type=True)

    @staticmethod
    def batch_of_packed(packed: list[bytes], ts: float | None = None) -> bytes:
        """The payload ``batch`` makes, from events already packed one by one."""
        head = msgpack.packb(time.time() if ts is None else ts)
        count = msgpack.Packer().pack_array_header(len(packed))
        return b"".join((b"\x93", head, count, *packed, msgpack.packb(DATA_PARALLEL_RANK)))

    def stored_event(self, rec: PagesStored, chains: WireChains) -> Any:
        """The ``BlockStored`` of one snapshot record, chained in ``chains``."""
        return self._stored(rec, chains)

    def _stored(self, rec: PagesStored, chains: WireChains) -> Any:
        digests, parent = chains.stored(rec)
        fmt = self.hash_format
        hashes = wire_hashes(digests, fmt)
        parent_hash = None if parent is None else wire_hashes([parent], fmt)[0]
        if self.hide_key is not None:
            lora_name, tokens = hidden_namespace(rec.extra_key, self.hide_key), []
        else:
            lora_name, tokens = rec.extra_key, rec.token_ids()
        if self.encoding == "array":
            return [
                "BlockStored",
                hashes,
                parent_hash,
                tokens,
                rec.page_size,
                None,
                self.medium,
                lora_name,
            ]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent_hash,
            "token_ids": tokens,
            "block_size": rec.page_size,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": lora_name,
        }

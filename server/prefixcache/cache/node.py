"""TreeNode: one edge of the radix tree, holding a run of tokens and their KV slots."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Self

import torch

from .errors import IntegrityError
from .key import TOKEN_BYTES, RadixKey

# Ids are process-wide (as in the reference) so a node id names one node across caches.
_node_ids = count(1)
# The value of a node that holds no slots: one that left the tree, or a node of a cache
# whose values are not per-token slots (the slot kind). Shared, and never written to.
NO_SLOTS = torch.empty((0,), dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class Namespace:
    """One isolated subtree: an ``extra_key`` and a token width, with its byte sizes."""

    extra_key: str | None
    token_width: int
    page_size: int

    @property
    def token_bytes(self) -> int:
        return TOKEN_BYTES * self.token_width

    @property
    def page_bytes(self) -> int:
        return TOKEN_BYTES * self.token_width * self.page_size


class TreeNode:
    """A node of the radix tree.

    ``key_bytes`` holds this node's own tokens (packed) and ``value`` their slots. The
    root and the namespace roots under it have empty keys (``key_len == 0``) and are
    never locked, evicted or counted. A node is *evicted* once it leaves the tree; any
    later lock or unlock on it is an error.

    ``lock_ref`` counts locks on this node and its descendants (a lock walks to the
    root); ``own_lock_ref`` counts the locks taken on this node itself, so that
    ``lock_ref == own_lock_ref + sum(child.lock_ref)`` always holds and an unlock that
    was never locked can be refused.

    The ``retain_*`` fields are a retention (retention.py): a priority (0: none) that
    ranks the node after unretained ones in eviction order until ``retain_until``, the
    seconds it lasts after each touch, and the owner it counts against;
    ``retained_children`` counts the children that have one.
    """

    children: dict[object, Self]
    # The root alone has no parent (None); every walk up stops below it (at the first
    # node with ``key_len == 0``), so the attribute is typed as always naming a node.
    parent: Self
    value: torch.Tensor
    hash_values: list[str] | None

    __slots__ = (
        # The service hands nodes out as opaque ids and looks them up weakly, so a
        # node that leaves the tree is forgotten without a callback from every path.
        "__weakref__",
        "children",
        "evicted",
        "hash_values",
        "hit_count",
        "id",
        "key_bytes",
        "key_len",
        "last_access_time",
        "lock_ref",
        "namespace",
        "own_lock_ref",
        "parent",
        "retain_owner",
        "retain_priority",
        "retain_seconds",
        "retain_until",
        "retained_children",
        "swa_boundary_id",
        "swa_lock_ref",
        "swa_tombstone",
        "value",
    )

    def __init__(
        self,
        namespace: Namespace | None = None,
        key_bytes: bytes = b"",
        value: torch.Tensor | None = None,
        parent: Self | None = None,
        last_access_time: int = 0,
    ) -> None:
        self.children = {}
        self.parent = parent  # type: ignore[assignment]  # None for the root only
        self.namespace = namespace
        self.key_bytes = key_bytes
        self.key_len = len(key_bytes) // namespace.token_bytes if namespace else 0
        self.value = NO_SLOTS if value is None else value
        self.lock_ref = 0
        self.own_lock_ref = 0
        self.swa_lock_ref = 0
        self.swa_tombstone = False
        self.swa_boundary_id: int | None = None
        self.last_access_time = last_access_time
        self.hit_count = 0
        self.hash_values = None
        self.retain_priority = 0
        self.retain_until = 0.0
        self.retain_seconds = 0.0
        self.retain_owner: object = None
        self.retained_children = 0
        self.evicted = False
        self.id = next(_node_ids)

    @property
    def key(self) -> RadixKey:
        """This node's own tokens as a RadixKey (decoded on demand)."""
        ns = self.namespace
        if ns is None:
            return RadixKey()
        return RadixKey.from_bytes(self.key_bytes, ns.token_width, ns.extra_key)

    def is_leaf(self) -> bool:
        return not self.children

    def require_namespace(self) -> Namespace:
        """This node's namespace; every node below the root has one, so a node without
        it is a broken tree (IntegrityError), not a caller's mistake."""
        ns = self.namespace
        if ns is None:
            raise IntegrityError(f"node {self.id} has no namespace")
        return ns

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={self.key_len}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}{', tombstone' if self.swa_tombstone else ''}"
            f"{', evicted' if self.evicted else ''})"
        )

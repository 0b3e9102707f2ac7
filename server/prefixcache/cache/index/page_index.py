"""PageIndex: find a cached page by its chained page hash, and pages known only by hash.

SGLang's HiCache storage backend names pages by their chained SHA-256 page hash (the
hash ``hash_pages`` computes, byte for byte) and never by their tokens. Two kinds of
pages answer such a name:

* **Token pages**: pages the tree caches under their tokens (Insert, Step, any worker).
  Eager page hashing gives each node its ``hash_values`` at insert, so an index from
  hash to page follows every node that joins or leaves the tree.
* **Hash pages**: pages stored by hash alone (SGLang writes a page's KV with its hash,
  never its tokens). They live in the same tree, under a *hash namespace* of their own,
  so they share the pool, the eviction order, locks, sessions, integrity checks and
  metrics with token pages instead of needing a second store beside the tree. A hash
  page's "tokens" are its 32-byte hash (then zeros to fill the page), in as many uint32
  words per token as make a page hold 32 bytes (``hash_page_width``). A chain of hash
  pages stored in one call is one path of the tree, so a lock on its last page protects
  the whole chain and eviction takes a chain from its end, as it does token pages.

The index maps ``(namespace, page hash)`` to the page's entry: the hash of the page
before it on its tree path (None at the namespace root) and the page's packed tokens.
Walking the parent links rebuilds the key from the namespace root to the page, which
``match_prefix`` then resolves to the page's current slots and node. Nothing in the
index points at a node, so a node split (which the caches do not report) changes no
entry, and a page's slots are always the tree's own.

It is the cache's ``listener``: it keeps the index and passes every event of a token
namespace on to the listener it wraps (the model's ``ChangeLog``). Hash pages are not
passed on: they are no token pages, so routers' KV events and workers' shadow indexes
never see them (``ChangeLog.snapshot`` skips their namespaces too).

Single-threaded like the caches.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import IntegrityError
from ..key import TOKEN_BYTES
from ..node import TreeNode

DIGEST_BYTES = 32
# No client namespace starts with a NUL, so this prefix never collides with one by
# accident (the service trusts its workers' KV anyway: see the module docstring).
HASH_NAMESPACE_PREFIX = "\x00prefixcache/hash-pages"

Namespace = tuple[str | None, int]


def hash_namespace(extra_key: str | None, token_width: int = 1) -> str:
    """The ``extra_key`` of the hash pages stored for the token namespace
    ``(extra_key, token_width)``; distinct namespaces give distinct names (None and ""
    included)."""
    tag = "" if extra_key is None else "=" + extra_key
    return f"{HASH_NAMESPACE_PREFIX}/w{token_width}{tag}"


def is_hash_namespace(extra_key: str | None) -> bool:
    """Whether ``extra_key`` names a namespace of hash pages."""
    return extra_key is not None and extra_key.startswith(HASH_NAMESPACE_PREFIX)


def hash_page_width(page_size: int) -> int:
    """uint32 words per token in a hash namespace: enough for a page to hold a digest."""
    words = DIGEST_BYTES // TOKEN_BYTES
    return max(1, -(-words // page_size))


def encode_hash_pages(page_hashes: list[str], page_size: int) -> bytes:
    """The packed "tokens" of hash pages: each page's digest, then zeros to fill it."""
    page_bytes = page_size * hash_page_width(page_size) * TOKEN_BYTES
    pad = b"\x00" * (page_bytes - DIGEST_BYTES)
    return b"".join(bytes.fromhex(h) + pad for h in page_hashes)


class PageEntry(NamedTuple):
    """One indexed page: the page before it on its tree path, and its packed tokens."""

    parent: str | None
    page: bytes


class PageIndex:
    """``(namespace, page hash) -> PageEntry`` for one cache (pass it as ``listener=``).

    Args:
        forward: The listener token-namespace events go on to (a ``ChangeLog``), or None.
    """

    def __init__(self, forward: Any = None) -> None:
        self.forward = forward
        # Two flat maps per namespace rather than one of PageEntry tuples: strings and
        # bytes are no objects the garbage collector tracks, tuples are, and a prompt's
        # insert indexes hundreds of pages (every one a tracked tuple made the
        # collector run, and its full passes grow with the index).
        self._parents: dict[Namespace, dict[str, str | None]] = {}
        self._tokens: dict[Namespace, dict[str, bytes]] = {}
        self._cache: Any = None

    # ------------------------------------------------------ the cache's side

    def cleared(self, cache: Any) -> None:
        self._cache = cache
        self._parents.clear()
        self._tokens.clear()
        if self.forward is not None:
            self.forward.cleared(cache)

    def pages_stored(self, node: TreeNode) -> None:
        ns = node.require_namespace()
        key = (ns.extra_key, ns.token_width)
        hashes, pages = _pages(node)
        if hashes:
            parents = self._parents.setdefault(key, {})
            parents.update(zip(hashes, [_last_hash(node.parent), *hashes[:-1]], strict=True))
            self._tokens.setdefault(key, {}).update(zip(hashes, pages, strict=True))
        if self.forward is not None and not is_hash_namespace(ns.extra_key):
            self.forward.pages_stored(node)

    def pages_removed(self, node: TreeNode) -> None:
        ns = node.require_namespace()
        key = (ns.extra_key, ns.token_width)
        parents = self._parents.get(key)
        if parents is not None:
            tokens = self._tokens[key]
            parent = _last_hash(node.parent)
            for page_hash in _pages(node)[0]:
                # Only the entry of this very position: a hash stored twice (two hash
                # pages of one digest on two paths) keeps the other one's entry.
                if page_hash in parents and parents[page_hash] == parent:
                    del parents[page_hash], tokens[page_hash]
                parent = page_hash
            if not parents:
                del self._parents[key], self._tokens[key]
        if self.forward is not None and not is_hash_namespace(ns.extra_key):
            self.forward.pages_removed(node)

    # ------------------------------------------------------- readers' side

    def namespaces(self) -> list[Namespace]:
        """The namespaces that hold indexed pages, a copy (callers may change the index)."""
        return list(self._parents)

    def find(self, namespace: Namespace, page_hash: str) -> PageEntry | None:
        """The page ``page_hash`` names in ``namespace``, or None."""
        parents = self._parents.get(namespace)
        if parents is None or page_hash not in parents:
            return None
        return PageEntry(parents[page_hash], self._tokens[namespace][page_hash])

    def path(self, namespace: Namespace, page_hash: str) -> tuple[bytes, int]:
        """The packed key from the namespace root through page ``page_hash``, and its
        page count.

        Raises:
            KeyError: the page is not indexed.
            IntegrityError: a page on its path is missing (a bookkeeping bug).
        """
        pages, _ = self.path_part(namespace, page_hash)
        pages.reverse()
        return b"".join(pages), len(pages)

    def path_part(
        self, namespace: Namespace, page_hash: str, limit: int | None = None, walked: int = 0
    ) -> tuple[list[bytes], str | None]:
        """Up to ``limit`` pages (None: all) of ``path``, from ``page_hash`` rootward,
        and the page the rest of the path ends at (None once the root is reached), for
        a caller that walks a long path in parts; ``walked``: the pages its earlier
        parts had (so that a loop is still found). Raises as ``path``."""
        parents, tokens = self._parents[namespace], self._tokens[namespace]
        pages: list[bytes] = []
        current: str | None = page_hash
        while current is not None and (limit is None or len(pages) < limit):
            if current not in parents:
                raise IntegrityError(
                    f"page index: page {current[:16]} on the path of {page_hash[:16]} is missing"
                )
            if walked + len(pages) >= len(parents):  # a page on its own path: never from SetPages
                raise IntegrityError(f"page index: the path of {page_hash[:16]} loops")
            pages.append(tokens[current])
            current = parents[current]
        return pages, current

    def __len__(self) -> int:
        return sum(len(table) for table in self._parents.values())

    def check(self) -> None:
        """Recompute the index from the tree; raise IntegrityError on any difference."""
        cache = self._cache
        parents: dict[Namespace, dict[str, str | None]] = {}
        tokens: dict[Namespace, dict[str, bytes]] = {}
        if cache is not None:
            for ns_root in cache.root_node.children.values():
                stack = list(ns_root.children.values())
                while stack:
                    node = stack.pop()
                    ns = node.namespace
                    key = (ns.extra_key, ns.token_width)
                    parent = _last_hash(node.parent)
                    for page_hash, page in zip(*_pages(node), strict=True):
                        parents.setdefault(key, {})[page_hash] = parent
                        tokens.setdefault(key, {})[page_hash] = page
                        parent = page_hash
                    stack.extend(node.children.values())
        if parents != self._parents or tokens != self._tokens:
            have = {ns: len(t) for ns, t in self._parents.items()}
            want = {ns: len(t) for ns, t in parents.items()}
            raise IntegrityError(
                f"page index out of step with the tree: indexes {have} "
                f"pages per namespace, the tree holds {want}"
            )


def _pages(node: TreeNode) -> tuple[list[str], list[bytes]]:
    """The hashes of ``node``'s whole pages (the chained hash of a token page, the digest
    a hash page holds) and the pages' packed tokens."""
    ns = node.require_namespace()
    size = ns.page_bytes
    data = node.key_bytes
    pages = [data[i : i + size] for i in range(0, len(data) - size + 1, size)]
    if is_hash_namespace(ns.extra_key):
        return [page[:DIGEST_BYTES].hex() for page in pages], pages
    hashes = node.hash_values
    if hashes is None:
        raise ValueError(f"node {node.id} has no page hashes (eager page hashing is off)")
    n = min(len(hashes), len(pages))
    return hashes[:n], pages[:n]


def _last_hash(parent: TreeNode | None) -> str | None:
    """The hash of the page a child's first page follows (None at a namespace root)."""
    ns = None if parent is None else parent.namespace
    if parent is None or ns is None or not parent.key_len:
        return None
    if is_hash_namespace(ns.extra_key):
        return parent.key_bytes[-ns.page_bytes :][:DIGEST_BYTES].hex()
    if not parent.hash_values:
        raise ValueError(f"node {parent.id} has no page hashes (eager page hashing is off)")
    return parent.hash_values[-1]

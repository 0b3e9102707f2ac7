"""A node below the root always has a namespace; the caches ask for it through one check
that raises IntegrityError (never an ``assert``, which ``python -O`` strips)."""

from __future__ import annotations

import pytest

from prefixcache.cache import IntegrityError, RadixCache, RadixKey
from prefixcache.cache.node import TreeNode


def test_a_node_without_a_namespace_is_a_broken_tree() -> None:
    with pytest.raises(IntegrityError, match="has no namespace"):
        TreeNode().require_namespace()


def test_every_cached_node_has_its_namespace() -> None:
    cache = RadixCache(page_size=1)
    cache.insert(RadixKey([1, 2, 3], extra_key="a"))
    cache.insert(RadixKey([1, 2, 9], extra_key="a"))  # splits: the upper part inherits it
    node = cache.match_prefix(RadixKey([1, 2], extra_key="a")).last_node
    assert node.require_namespace().extra_key == "a"
    assert node.parent.require_namespace().extra_key == "a"

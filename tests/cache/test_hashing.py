"""The hash test vectors of docs/semantics.md and the root-down page-hash chain
(departure 13: the chain never depends on which node is hashed first)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from prefixcache.cache import RadixCache, RadixKey, hash_bytes, hash_to_int64, hash_token_ids

H12 = "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f"
H1234 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
H34_AFTER_12 = "c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c"
H56_CHAINED = "4a8a26efbf98ddb0eca98c8913c209b45b7241fb0ccbdb559f74dafba44b7c60"

VECTORS = [
    (
        [],
        None,
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        -2039914840885289964,
    ),
    (
        [0],
        None,
        "df3f619804a92fdb4057192dc43dd748ea778adc52bc498ce80524c014b81119",
        -2360060374177730597,
    ),
    ([1, 2], None, H12, 3817746824117602890),
    (
        [1, 2, 3],
        None,
        "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d",
        5059399719711515881,
    ),
    (
        [1, 2, 3],
        "",
        "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d",
        5059399719711515881,
    ),
    ([1, 2, 3, 4], None, H1234, -3488128144981237669),
    ([(1, 2), (3, 4)], None, H1234, -3488128144981237669),
    (
        [4294967295],
        None,
        "ad95131bc0b799c0b1af477fb14fcf26a6a9f76079e48bf090acb7e8367bfd0e",
        -5938819523699828288,
    ),
    ([3, 4], H12, H34_AFTER_12, -4216701448867210342),
    (
        [5, 6],
        H1234,
        "ccb860d400a5043f4378cf6408132e442be724ef376ab2f53169b5d9e958f75f",
        -3695097030597344193,
    ),
    ([5, 6], H34_AFTER_12, H56_CHAINED, 5371148316746243504),
    (
        [7],
        H56_CHAINED,
        "61be5ffa47d1cb094f54026bfff214eb6ec15e1b9654edd9edcf9d76d3310425",
        7043172395805428489,
    ),
    (
        [5, 6],
        None,
        "f1833c11f88585608c320b53224d2642b97af5fdb9cae59c13fcab53f37c4b06",
        -1043924640738212512,
    ),
    (
        [],
        "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d",
        "1e6a6101faf90f6ef73e7c420c9761be04062841a341b22db313f2a4adb076da",
        2191670829802655598,
    ),
]


@pytest.mark.parametrize(("tokens", "prior", "digest", "as_int64"), VECTORS)
def test_hash_vectors(tokens: list, prior: str | None, digest: str, as_int64: int) -> None:
    """hash_token_ids and hash_to_int64 are byte-exact with the reference."""
    assert hash_token_ids(tokens, prior) == digest
    assert hash_to_int64(digest) == as_int64


@pytest.mark.parametrize("bad", [[4294967296], [-1]])
def test_out_of_range_token_raises_overflow(bad: list[int]) -> None:
    """Ids outside uint32 raise OverflowError, as in the reference."""
    with pytest.raises(OverflowError):
        hash_token_ids(bad)


def test_non_hex_prior_raises() -> None:
    """A prior that is not hex raises ValueError."""
    with pytest.raises(ValueError):
        hash_token_ids([1], "not hex")


def test_hash_to_int64_edges() -> None:
    """The first 16 hex digits map to signed two's complement."""
    assert hash_to_int64("f" * 16) == -1
    assert hash_to_int64("8000000000000000") == -(2**63)
    assert hash_to_int64("7fffffffffffffff") == 2**63 - 1


def test_hash_bytes_vectors() -> None:
    """hash_bytes is the first 8 SHA-256 bytes, unsigned big-endian."""
    assert hash_bytes(b"") == 16406829232824261652
    assert hash_bytes(b"abc") == 13436514500253700074
    assert hash_bytes(bytes([0, 1, 2, 3])) == 382487942374956898
    digest = hashlib.sha256(b"xyz").hexdigest()
    assert hash_bytes(b"xyz") == hash_to_int64(digest) % 2**64


def tree_1234_5678(eager: bool) -> tuple[RadixCache, object, object]:
    cache = RadixCache(page_size=2, eager_page_hashes=eager)
    parent = cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4)).last_node
    child = cache.insert(RadixKey([1, 2, 3, 4, 5, 6, 7, 8]), torch.arange(8)).last_node
    return cache, parent, child


CHAIN = [H12, H34_AFTER_12, H56_CHAINED, hash_token_ids([7, 8], H56_CHAINED)]


def test_child_first_hashing_still_chains() -> None:
    """Departure 13: hashing a child first hashes its ancestors first, root-down."""
    cache, parent, child = tree_1234_5678(eager=False)
    assert parent.hash_values is None
    assert cache.compute_node_hash(child) == CHAIN[2:]
    assert parent.hash_values == CHAIN[:2]


def test_eager_hashes_are_there_at_insert_and_survive_splits() -> None:
    """With eager_page_hashes every node is hashed at insert; a split divides the chain."""
    cache, parent, child = tree_1234_5678(eager=True)
    assert parent.hash_values == CHAIN[:2] and child.hash_values == CHAIN[2:]
    upper = cache.match_prefix(RadixKey([1, 2, 9, 9])).last_node
    assert upper.hash_values == CHAIN[:1] and parent.hash_values == CHAIN[1:2]
    cache.check_integrity()


def test_namespaces_hash_from_a_fresh_chain() -> None:
    """A namespace's first page has no prior, exactly as under the root."""
    cache = RadixCache(page_size=2, eager_page_hashes=True)
    node = cache.insert(RadixKey([1, 2], "lora"), torch.arange(2)).last_node
    assert node.hash_values == [H12]

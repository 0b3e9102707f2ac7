"""Page seals: a seal checks only the exact bytes under the exact identity it was made
for, with the kind its reader expects."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.server.memory.page_seal import (
    SEAL_BYTES,
    PageSeal,
    address_views,
    derive_key,
    identity,
    read_secret,
)

SECRET = bytes(range(32))
KEYS = [None, derive_key(SECRET, "tier-pages", "acme")]
fields = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8),
                   st.binary(max_size=8))
parts = st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=4)


@pytest.mark.parametrize("key", KEYS, ids=["digest", "mac"])
@given(ident=st.binary(max_size=32), page=parts, data=st.data())
def test_a_seal_checks_its_own_bytes_and_no_changed_byte(key, ident, page, data) -> None:
    seal = PageSeal(key)
    made = seal.seal(ident, page)
    assert len(made) == SEAL_BYTES
    assert seal.check(ident, page, made)
    flat = bytearray(b"".join(page))
    if flat:
        i = data.draw(st.integers(0, len(flat) - 1))
        flat[i] ^= 1 << data.draw(st.integers(0, 7))
        assert not seal.check(ident, [bytes(flat)], made)
    other = data.draw(st.binary(max_size=32).filter(lambda b: b != ident))
    assert not seal.check(other, page, made)
    bad = bytearray(made)
    bad[data.draw(st.integers(0, SEAL_BYTES - 1))] ^= 1
    assert not seal.check(ident, page, bytes(bad))


def test_parts_are_one_stream_and_their_split_does_not_matter() -> None:
    seal = PageSeal(None)
    made = seal.seal(b"id", [b"abc", b"def"])
    assert seal.check(b"id", [b"abcdef"], made)
    assert seal.check(b"id", [b"a", b"", b"bcdef"], made)


def test_a_reader_takes_only_its_own_kind_of_seal() -> None:
    keyed, keyless = PageSeal(KEYS[1]), PageSeal(None)
    assert not keyed.check(b"id", [b"x"], keyless.seal(b"id", [b"x"]))  # no downgrade
    assert not keyless.check(b"id", [b"x"], keyed.seal(b"id", [b"x"]))
    other_tenant = PageSeal(derive_key(SECRET, "tier-pages", "beta"))
    assert not other_tenant.check(b"id", [b"x"], keyed.seal(b"id", [b"x"]))
    for junk in (b"", bytes(SEAL_BYTES), b"\x01" * SEAL_BYTES, b"\x02" + bytes(40)):
        assert not keyed.check(b"id", [b"x"], junk)
        assert not keyless.check(b"id", [b"x"], junk)


def test_macs_take_a_fresh_nonce_each_time() -> None:
    keyed = PageSeal(KEYS[1])
    first, second = keyed.seal(b"id", [b"x"]), keyed.seal(b"id", [b"x"])
    assert first != second and keyed.check(b"id", [b"x"], first)
    assert keyed.check(b"id", [b"x"], second)


@given(st.lists(fields, max_size=4), st.lists(fields, max_size=4))
def test_identities_of_different_fields_differ(a, b) -> None:
    def norm(fs):  # bytes and str with the same bytes encode alike, by design
        return [f.encode() if isinstance(f, str) else f for f in fs]
    if norm(a) != norm(b):
        assert identity(*a) != identity(*b)


def test_pool_memory_is_sealed_in_place() -> None:
    rows = np.arange(64, dtype=np.float32)
    views = address_views([rows.ctypes.data, rows.ctypes.data + 128], [128, 128])
    seal = PageSeal(None)
    made = seal.seal(b"p", views)
    assert seal.check(b"p", [rows.tobytes()], made)
    rows[3] = -1.0  # a late write into the pool
    assert not seal.check(b"p", views, made)


def test_keys_need_a_real_secret(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 32"):
        derive_key(b"short", "tier-pages", None)
    assert derive_key(SECRET, "tier-pages", None) != derive_key(SECRET, "tier-keys", None)
    assert derive_key(SECRET, "p", None) != derive_key(SECRET, "p", "")
    (tmp_path / "s").write_bytes(b"tiny\n")
    with pytest.raises(ValueError, match="head -c 32 /dev/urandom"):
        read_secret(str(tmp_path / "s"))
    (tmp_path / "s").write_bytes(SECRET)
    assert read_secret(str(tmp_path / "s")) == SECRET
    with pytest.raises(ValueError, match="32 bytes"):
        PageSeal(b"k" * 16)

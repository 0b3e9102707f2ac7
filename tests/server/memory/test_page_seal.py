"""Page seals: a seal checks only the exact bytes under the exact identity it was made
for, with the kind its reader expects."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.server.memory.page_seal import (
    BAD_SEAL,
    SEAL_BYTES,
    SEAL_MISMATCH,
    WRONG_KIND,
    IntegrityFailures,
    MemoryRegions,
    PageSeal,
    address_views,
    derive_key,
    identity,
)

SECRET = bytes(range(32))
KEYS = [None, derive_key(SECRET, "tier-pages", "acme")]
fields = st.one_of(
    st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.binary(max_size=8)
)
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


def test_keys_need_a_real_secret() -> None:
    with pytest.raises(ValueError, match="at least 32"):
        derive_key(b"short", "tier-pages", None)
    assert derive_key(SECRET, "tier-pages", None) != derive_key(SECRET, "tier-keys", None)
    assert derive_key(SECRET, "p", None) != derive_key(SECRET, "p", "")
    with pytest.raises(ValueError, match="32 bytes"):
        PageSeal(b"k" * 16)


def test_a_refusal_says_why() -> None:
    keyed, keyless = PageSeal(KEYS[1]), PageSeal(None)
    for seal in (keyed, keyless):
        made = seal.seal(b"id", [b"x"])
        assert seal.verdict(b"id", [b"x"], made) is None
        assert seal.verdict(b"id", [b"y"], made) == SEAL_MISMATCH
        assert seal.verdict(b"other", [b"x"], made) == SEAL_MISMATCH
        for junk in (b"", bytes(SEAL_BYTES), b"\x07" + bytes(SEAL_BYTES - 1), made + b"!"):
            assert seal.verdict(b"id", [b"x"], junk) == BAD_SEAL
    assert keyed.verdict(b"id", [b"x"], keyless.seal(b"id", [b"x"])) == WRONG_KIND
    assert keyless.verdict(b"id", [b"x"], keyed.seal(b"id", [b"x"])) == WRONG_KIND


def test_regions_give_views_of_their_parts_and_refuse_others() -> None:
    a, b = np.arange(64, dtype=np.uint8), np.arange(100, 164, dtype=np.uint8)
    regions = MemoryRegions([(b.ctypes.data, b.nbytes), (a.ctypes.data, a.nbytes)])
    got = regions.views([a.ctypes.data + 3, b.ctypes.data, b.ctypes.data + 60], [5, 64, 4])
    assert [bytes(v) for v in got] == [a[3:8].tobytes(), b.tobytes(), b[60:].tobytes()]
    for ptr, size in ((a.ctypes.data + 60, 8), (a.ctypes.data - 1, 1)):
        with pytest.raises(ValueError, match="no known region"):
            regions.views([ptr], [size])


def test_failures_are_counted_and_warned_of_at_a_bounded_rate(caplog) -> None:
    now = [0.0]
    failures = IntegrityFailures(clock=lambda: now[0])
    assert failures.counts[("snapshot", "size")] == 0  # every pair exported from the start
    with caplog.at_level("WARNING", logger="prefixcache.server"):
        for _ in range(5):
            failures.count("tier", SEAL_MISMATCH, model="m")
        now[0] = 61.0
        failures.count("tier", BAD_SEAL)
    assert failures.counts[("tier", SEAL_MISMATCH)] == 5 and failures.total("tier") == 6
    warned = [r for r in caplog.records if "seal did not check" in r.getMessage()]
    assert [r.pages for r in warned] == [1, 5]  # the first at once, the rest a minute on

"""The disk tier under real vLLM engines: a prompt one engine saved is evicted from a
small pool (2048 tokens) to disk (by other prompts' allocations, then an Evict), and a new engine
loads it: the sidecar reads it back from disk, its KV bytes are the ones saved, bit for
bit, and the new engine's output is vLLM's own prefix-cache hit's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "p16"
BLOCK = 32


@pytest.fixture(scope="module")
def disk_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    tmp = tmp_path_factory.mktemp("pcd")
    (tmp / "disk").mkdir()
    # A pool of 2048 tokens: its write-back staging (a quarter) holds a prompt's pages.
    side = Sidecar(tmp, size=2048, disk=tmp / "disk")
    yield side
    side.stop()


def _kv(sidecar: Sidecar, tokens: list[int]) -> tuple[int, list]:
    """The prompt's cached prefix and its KV (every K and V buffer), read under a lock."""
    client = sidecar.client
    with client.session() as s:
        reply = client.match(MODEL, tokens, session=s, lock=True)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv(MODEL, reply.slots, session=s)
        client.unlock(reply.lock_id, session=s)
    return reply.prefix_len, [*data.k, *data.v]


def test_a_prompt_evicted_to_disk_is_loaded_by_a_new_engine(
    disk_sidecar: Sidecar, model_dir: Path, tmp_path: Path
) -> None:
    saver = Engine(tmp_path, "disk-saver", model_dir, BLOCK, disk_sidecar, MODEL)
    try:
        (prompt,) = prompts(41, (300,))
        saver.generate([prompt])
        disk_sidecar.wait_cached(MODEL, [prompt], unit=BLOCK)
        cached, saved = _kv(disk_sidecar, prompt)
        assert cached == 288  # the whole blocks but the one holding the last token
        own = saver.generate([prompt])  # what vLLM's own hit answers (its local cache)
        assert own[0]["cached"] == expected_hit(len(prompt), BLOCK)
        # Other prompts fill the small pool: allocations evict the first one's pages
        # (written back to disk); an Evict then takes whatever is left of it.
        saver.generate(prompts(42, (300,) * 6))
        disk_sidecar.client.evict(MODEL, 1 << 20)
        deadline = time.monotonic() + 60
        while disk_sidecar.metric("prefixcache_disk_pages") < cached // 16:
            assert time.monotonic() < deadline, (
                "the prompt's pages never reached the disk: dropped "
                f"{disk_sidecar.metric('prefixcache_disk_demote_dropped_pages_total')}, "
                f"demoted {disk_sidecar.metric('prefixcache_disk_demoted_pages_total')}"
            )
            time.sleep(0.1)
    finally:
        saver.close()
    before = disk_sidecar.metric("prefixcache_disk_promoted_bytes_total")
    loader = Engine(tmp_path, "disk-loader", model_dir, BLOCK, disk_sidecar, MODEL)
    try:
        got = loader.generate([prompt])
        assert got[0]["cached"] == expected_hit(len(prompt), BLOCK), loader.log_tail()
        assert disk_sidecar.metric("prefixcache_disk_promoted_bytes_total") > before
        assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)
        again, loaded = _kv(disk_sidecar, prompt)
        assert again >= cached
        for a, b in zip(saved, loaded, strict=True):  # bit for bit
            assert a[:cached].numpy().tobytes() == b[:cached].numpy().tobytes()
    finally:
        loader.close()

"""The sidecar SIGKILLed while an engine is loading from it: no request fails, and the
outputs are still vLLM's own (failed loads are recomputed). After a restart, the
engines save and load again with no restart of their own.

This test kills the session's sidecar and leaves it restarted: the other modules use
fresh prompts, so they do not depend on what the old pool held.
"""

from __future__ import annotations

import time

import pytest
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def wait_for_locks(sidecar: Sidecar, model: str, timeout: float = 120.0) -> None:
    """Until some session holds a lock in ``model``: an engine's lookups have locked
    their hits and its loads are under way (the locks last until the requests end)."""
    deadline = time.monotonic() + timeout
    while sidecar.client.stats(model)[model].locks == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("no engine locked a hit")
        time.sleep(0.01)


def hits_after_restart(
    sidecar: Sidecar, saver: Engine, loader: Engine, timeout: float = 90.0
) -> tuple[list[list[int]], list[dict]]:
    """Fresh prompts that ``saver`` saved into the restarted sidecar and ``loader`` then
    loaded, with ``loader``'s outputs. Either engine's first tries may miss: its channel
    reconnects with gRPC's backoff, and its connector does not ask a service that did
    not answer lately (a save is skipped, a lookup answers a miss; never queued). Each
    try takes new prompts, which neither engine has computed."""
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        tries += 1
        again = prompts(1000 + tries, (150, 230))
        saver.generate(again)
        try:
            sidecar.wait_cached("p16", again, unit=32, timeout=5.0)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{saver.name} saved nothing in {timeout} s after the "
                    f"restart ({tries} tries):\n{saver.log_tail()}"
                ) from None
            continue
        loaded = loader.generate(again)
        hits = [o["cached"] for o in loaded]
        if hits == [expected_hit(len(p), 32) for p in again]:
            return again, loaded
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{loader.name} loaded {hits} in {timeout} s after the "
                f"restart ({tries} tries):\n{loader.log_tail()}"
            )


def test_sidecar_killed_mid_batch_then_restarted(sidecar: Sidecar, engines: dict) -> None:
    a, b = engines[32, "p16", "a"], engines[32, "p16", "b"]
    batch = prompts(21, [200 + 9 * i for i in range(16)])
    a.generate(batch)
    sidecar.wait_cached("p16", batch, unit=32)
    own = a.generate(batch, max_tokens=8)

    b.submit(batch, max_tokens=8)
    wait_for_locks(sidecar, "p16")
    sidecar.kill()
    got = b.result()["outputs"]
    failed = [i for i, o in enumerate(got) if o["finish"] != "length" or len(o["tokens"]) != 8]
    assert not failed, f"requests {failed} failed:\n{b.log_tail()}"
    assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)

    sidecar.start()  # a new pool, empty: a saves, and b hits, with no restart of either
    again, loaded = hits_after_restart(sidecar, a, b)
    assert not (bad := mismatches(loaded, a.generate(again), TOL)), "\n".join(bad)

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


def saved_after_restart(sidecar: Sidecar, engine: Engine, timeout: float = 60.0
                        ) -> list[list[int]]:
    """Fresh prompts that ``engine`` saved into the restarted sidecar. Its first saves
    may be skipped: its channel reconnects with gRPC's backoff, and the connector does
    not ask a service that did not answer lately (saves are skipped, never queued)."""
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        tries += 1
        again = prompts(1000 + tries, (150, 230))
        engine.generate(again)
        try:
            sidecar.wait_cached("p16", again, unit=32, timeout=5.0)
            return again
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{engine.name} saved nothing in {timeout} s after the "
                                   f"restart ({tries} tries):\n{engine.log_tail()}"
                                   ) from None


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
    again = saved_after_restart(sidecar, a)
    loaded = b.generate(again)
    assert [o["cached"] for o in loaded] == [expected_hit(len(p), 32) for p in again], \
        b.log_tail()
    assert not (bad := mismatches(loaded, a.generate(again), TOL)), "\n".join(bad)

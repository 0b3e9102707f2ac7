"""A KV layout that vLLM's engine does not write disables the connector with one log
line, across vLLM's processes: the worker (which finds out, in its own process) tells
the scheduler side (in the engine core's), which then neither looks up nor saves. The
engine computes everything itself, right.

The layout is forced (``kv_layout: bhn2d``, what FlashAttention reads) on vLLM's CPU
backend: the connector's check against vLLM's own cache-write op refuses it, as it
would refuse any layout it does not know.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DISABLED = re.compile(r"prefixcache connector disabled: .*does not write K/V")
# What the connector logs per request when it loads or saves for nothing.
PER_REQUEST = re.compile(r"prefixcache (load|save) of request")


def test_a_layout_vllm_does_not_write_disables_the_connector_with_one_line(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, sidecar: Sidecar, engines: dict
) -> None:
    engines.close("p32")
    saver = engines[32, "p16", "a"]
    batch = prompts(41, (130, 200))
    saver.generate(batch)
    sidecar.wait_cached("p16", batch, unit=32)  # a lookup would hit
    own = saver.generate(batch)
    assert [o["cached"] for o in own] == [expected_hit(len(p), 32) for p in batch]

    forced = Engine(
        tmp_path_factory.mktemp("disabled"),
        "forced-bhn2d",
        model_dir,
        32,
        sidecar,
        "p16",
        pc_extra={"kv_layout": "bhn2d"},
    )
    try:
        got = forced.generate(batch)
        # The first step's lookups leave before the worker's word is back; after it,
        # the service is asked nothing: no lookup, no save's allocation.
        before = sidecar.client.stats("p16")["p16"]
        again = forced.generate(prompts(42, (150, 90)))
        log = forced.log.read_text(errors="replace")
    finally:
        forced.close()
    assert [o["cached"] for o in got] == [0, 0], log[-4000:]  # nothing loaded
    assert all(len(o["tokens"]) == 6 for o in again)
    assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)
    assert len(DISABLED.findall(log)) == 1, log[-4000:]
    assert not PER_REQUEST.search(log), [
        line for line in log.splitlines() if PER_REQUEST.search(line)
    ][:5]
    after = sidecar.client.stats("p16")["p16"]
    assert (after.locks, after.session_slots) == (0, 0)
    assert after.match_tokens_total == before.match_tokens_total

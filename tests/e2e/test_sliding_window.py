"""Sliding-window models through the connector, with vLLM's hybrid KV cache manager on:
what a new engine loads is vLLM's own output, tokens and logprobs.

``mistral``: every layer attends to the last ``WINDOW`` tokens (one KV cache group).
``gemma3``: three sliding-window layers and a full-attention one (four groups, each
with its own block table; the layers' copies use their group's). vLLM frees a
sliding-window block once it leaves the window, while the request runs, and the
finished request's table holds the null block (id 0) in its place: the connector must
have saved those blocks before, or save nothing of them, and never save or load the
null block. ``short`` hits only blocks that left the window in the saver (the blocks
freed first); ``long`` hits most of a prompt.

The saver never loads (``load: false``): its outputs are vLLM's own, from its own
prefix cache where vLLM hits (``long``; vLLM 0.32 keeps no hit for ``short`` here) or
computed from scratch, never a load of what the connector saved.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e import tiny_llama
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WINDOW = 64
BLOCK = 32
# vLLM's warning when a connector makes it turn its hybrid KV cache manager off.
HMA_OFF = "Turning off hybrid kv cache manager"
MODELS = {
    "mistral": ("swa", lambda path: tiny_llama.build(path, sliding_window=WINDOW)),
    "gemma3": ("hybrid", lambda path: tiny_llama.build_gemma3(path, sliding_window=WINDOW)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def swa_engines(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    sidecar: Sidecar,
    engines: dict,
) -> Iterator[tuple[str, Engine, Engine]]:
    engines.close()  # the Llama engines: at most two engines at once here
    pc_model, build = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model = build(tmp / "model")
    saver = Engine(
        tmp, f"{request.param}-saver", model, BLOCK, sidecar, pc_model, pc_extra={"load": False}
    )
    try:
        loader = Engine(tmp, f"{request.param}-loader", model, BLOCK, sidecar, pc_model)
    except BaseException:
        saver.close()
        raise
    yield pc_model, saver, loader
    loader.close()
    saver.close()


def test_loaded_output_is_vllms_own(
    sidecar: Sidecar, swa_engines: tuple[str, Engine, Engine]
) -> None:
    pc_model, saver, loader = swa_engines
    p1, p2, s1, s2, s3, s4 = prompts(41, (300, 300, 20, 20, 20, 20))
    saved = [p1 + s1, p2 + s2]
    saver.generate(saved, max_tokens=8)
    assert saver.reset_prefix_cache()  # no finished request holds blocks for a save
    sidecar.wait_cached(pc_model, saved, unit=BLOCK)
    short, long = p1[:140] + s3, p2 + s4
    batch = [short, long]
    want = [expected_hit(len(short), BLOCK), 288]
    got = loader.generate(batch, max_tokens=8)
    assert [o["cached"] for o in got] == want, loader.log_tail()
    saver.generate(saved, max_tokens=8)  # its own cache again, for its own hit on long
    own = saver.generate(batch, max_tokens=8)  # vLLM's own KV, hit or computed
    assert own[1]["cached"] == want[1]  # the long prompt: vLLM's own hit
    assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)
    log = loader.log_tail(1 << 20)
    assert HMA_OFF not in log  # each group its own blocks, not all as full attention
    assert "prefixcache connector disabled" not in log

"""A sliding-window model (Mistral-style: every layer attends to the last ``WINDOW``
tokens, one KV cache group) through the connector: what a new engine loads is vLLM's
own prefix-cache hit, tokens and logprobs.

vLLM frees a sliding-window block once it leaves the window, while the request runs,
and the finished request's block table holds the null block (id 0) in its place: the
connector must have saved those blocks before, or save nothing of them, and never
save or load the null block. ``short`` hits only blocks that left the window in the
saver (the blocks freed first); ``long`` hits most of a prompt.

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


@pytest.fixture(scope="module")
def swa_engines(tmp_path_factory: pytest.TempPathFactory, sidecar: Sidecar,
                engines: dict) -> Iterator[tuple[Engine, Engine]]:
    engines.close()  # the Llama engines: at most two engines at once here
    tmp = tmp_path_factory.mktemp("swa")
    model = tiny_llama.build(tmp / "model", sliding_window=WINDOW)
    saver = Engine(tmp, "swa-saver", model, BLOCK, sidecar, "swa", pc_extra={"load": False})
    try:
        loader = Engine(tmp, "swa-loader", model, BLOCK, sidecar, "swa")
    except BaseException:
        saver.close()
        raise
    yield saver, loader
    loader.close()
    saver.close()


def test_loaded_output_is_vllms_own_hit(sidecar: Sidecar,
                                        swa_engines: tuple[Engine, Engine]) -> None:
    saver, loader = swa_engines
    p1, p2, s1, s2, s3, s4 = prompts(41, (300, 300, 20, 20, 20, 20))
    saved = [p1 + s1, p2 + s2]
    saver.generate(saved, max_tokens=8)
    sidecar.wait_cached("swa", saved, unit=BLOCK)
    short, long = p1[:140] + s3, p2 + s4
    batch = [short, long]
    want = [expected_hit(len(short), BLOCK), 288]
    got = loader.generate(batch, max_tokens=8)
    assert [o["cached"] for o in got] == want, loader.log_tail()
    own = saver.generate(batch, max_tokens=8)  # vLLM's own KV, hit or computed
    assert own[1]["cached"] == want[1]  # the long prompt: vLLM's own hit
    assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)

"""One offline vLLM engine (``vllm.LLM``) in its own process, driven over a pipe.

Started by ``e2e_support.Engine``: ``python engine_proc.py '<json options>'``. vLLM's
logs go to stderr; the protocol has stdout to itself: one JSON object per line each
way. Commands: ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}`` answers
``{"outputs": [{"tokens", "logprobs", "cached", "finish"}], "seconds"}``;
``{"op": "metrics"}`` answers vLLM's counters by name; ``{"op": "reset"}`` answers
``{"reset": <what LLM.reset_prefix_cache() returned>}``; ``{"op": "quit"}`` ends it.
Starting an engine costs tens of seconds on two cores, so each test module keeps its
engines for all its checks. vLLM's CPU build runs three processes per engine (this one,
the engine core and its worker: about 2 GB in all), so the tests close the engines they
no longer need.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def connector_config(target: str, model: str, kv_role: str = "kv_both") -> dict[str, Any]:
    return {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm.connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": target, "model": model},
    }


def main() -> None:
    opts = json.loads(sys.argv[1])
    # The protocol keeps the real stdout; everything vLLM prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if opts.get("kv_transfer_config"):  # another connector, as given (bench/peers_vllm.py)
        kwargs["kv_transfer_config"] = opts["kv_transfer_config"]
    elif opts.get("pc_model"):
        kwargs["kv_transfer_config"] = connector_config(
            opts["target"], opts["pc_model"], opts.get("kv_role", "kv_both")
        )
        kwargs["kv_transfer_config"]["kv_connector_extra_config"].update(opts.get("pc_extra") or {})
    llm = LLM(
        opts["model_dir"],
        dtype=opts.get("dtype", "float32"),
        block_size=opts["block_size"],
        enforce_eager=True,
        max_model_len=opts.get("max_model_len", 4096),
        enable_prefix_caching=True,
        kv_cache_memory_bytes=opts.get("kv_bytes", 128 << 20),
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "metrics":
            reply: dict[str, Any] = {
                m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")
            }
        elif cmd["op"] == "reset":
            reply = {"reset": bool(llm.reset_prefix_cache())}
        elif cmd["op"] == "generate":
            params = SamplingParams(
                temperature=0.0, max_tokens=cmd["max_tokens"], logprobs=1, ignore_eos=True
            )
            start = time.perf_counter()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], params, use_tqdm=False
            )
            seconds = time.perf_counter() - start
            reply = {"seconds": seconds, "outputs": [_output(o) for o in outs]}
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        proto.write(json.dumps(reply) + "\n")


def _output(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    return {
        "tokens": list(c.token_ids),
        "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
        "cached": o.num_cached_tokens,
        "finish": c.finish_reason,
    }


if __name__ == "__main__":
    main()

"""Plug-ins that let stock inference engines use prefixcache through their own extension
points, with configuration only (``integrations.vllm``: a vLLM KV connector;
``integrations.sglang``: an SGLang HiCache storage backend).

Each integration is an engine-free core, tested without the engine, under a thin adapter
module that is the only place importing the engine.
"""

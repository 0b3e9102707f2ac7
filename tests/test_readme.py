"""The documents' python examples (README.md and docs/*.md) run as written."""

from __future__ import annotations

from pathlib import Path

from doc_pages import DOCS, README, code_blocks
from harness import serve_process

from prefixcache.client import PrefixCacheClient


def test_library_example_runs_and_reuses_prefixes() -> None:
    """The prefill example caches a prompt and a second call with the same prefix hits it."""
    blocks = [
        b
        for _, b in code_blocks("python", DOCS / "clients.md")
        if "def prefill(token_ids: list[int], lora" in b
    ]
    assert len(blocks) == 1, "docs/clients.md has no (or two) library prefill examples"
    scope: dict = {}
    exec(blocks[0], scope)
    cache, allocator = scope["cache"], scope["allocator"]
    free_before = allocator.available_size()
    scope["prefill"](list(range(100)))
    assert cache.total_size() == 96  # 6 pages; the 4-token tail is not cached
    scope["prefill"](list(range(90)) + [7] * 20)
    assert cache.total_size() == 96 + 16  # the shared 80 tokens were reused
    assert allocator.available_size() == free_before - cache.total_size()
    scope["prefill"](list(range(40)), lora="adapter-1")
    assert cache.total_size() == 96 + 16 + 32
    cache.check_integrity()


def test_every_python_example_runs() -> None:
    """Each python block of the README and docs/ runs on its own (the later ones assert
    themselves)."""
    blocks = code_blocks("python")
    assert len(blocks) >= 3
    for page, block in blocks:
        try:
            exec(block, {})
        except Exception as exc:
            raise AssertionError(f"a python block of {page.name} fails: {exc!r}\n{block}") from exc


def test_the_readme_client_example_runs_against_a_server(tmp_path: Path) -> None:
    """The README's ten-line client example, against a real `prefixcache serve` on the
    default model: its prompt is cached (whole pages) and its session left nothing held."""
    (block,) = [b for _, b in code_blocks("py", README)]
    assert len(block.strip().splitlines()) <= 10
    with serve_process(tmp_path, "server: {shm_dir: 'off'}\n") as (_, address):
        scope: dict = {}
        exec(block.replace("unix:/tmp/prefixcache.sock", address), scope)
        assert scope["client"].fail_open_count == 0  # it really reached the server
        with PrefixCacheClient(address) as client:
            hit = client.match("default", scope["token_ids"])
            assert hit.prefix_len == 96  # 100 tokens, pages of 16: the tail is not cached
            stats = client.stats("default")
        scope["client"].close()
    (model,) = stats.models
    assert (model.locks, model.protected_tokens, stats.sessions) == (0, 0, 0), stats

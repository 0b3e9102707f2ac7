"""The README's library example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_library_example_runs_and_reuses_prefixes() -> None:
    """The prefill example caches a prompt and a second call with the same prefix hits it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README.md has no python example"
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
    """Each python block of the README runs on its own (the later ones assert themselves)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) >= 3
    for block in blocks:
        exec(block, {})

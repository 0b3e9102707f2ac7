"""The backend's extra-config, rank namespaces, host layouts and the v2 calls, without a
server (the v2 calls over a stand-in core)."""

from __future__ import annotations

import pytest
import torch
from hicache_hosts import HostPool

from prefixcache.integrations.sglang import HostLayout, Ranks, Settings, rank_namespace
from prefixcache.integrations.sglang.v2 import exists_v2, transfer_v2


def test_defaults_and_templates() -> None:
    s = Settings.parse({"model": "llama-tp{tp_rank}-pp{pp_rank}"}, Ranks(1, 2, 0, 1))
    assert (s.model, s.target, s.transfer, s.token_width) == (
        "llama-tp1-pp0",
        "unix:/tmp/prefixcache.sock",
        "auto",
        1,
    )
    assert Settings.parse({}, Ranks(), model_name="served").model == "served"


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({}, 'set "model"'),
        ({"model": "m", "transfer": "ftp"}, "transfer"),
        ({"model": "m", "timeout": 0}, "timeout"),
        ({"model": "m", "timeout": "soon"}, "timeout"),
        ({"model": "m{nope}"}, "template"),
    ],
)
def test_bad_settings_are_refused(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Settings.parse(cfg, Ranks())


def test_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PC_TOKEN", "s3cret")
    assert Settings.parse({"model": "m", "token_env": "PC_TOKEN"}, Ranks()).token == "s3cret"


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        (Ranks(), None),
        (Ranks(tp_rank=1, tp_size=4), "#sglang:tp1of4"),
        (Ranks(tp_rank=1, tp_size=4, is_mla=True), None),  # MLA ranks hold the same latent
        (Ranks(pp_rank=1, pp_size=2), "#sglang:pp1of2"),
        (Ranks(tp_rank=0, tp_size=2, cp_rank=1, cp_size=2), "#sglang:tp0of2.cp1of2"),
    ],
)
def test_rank_namespaces(ranks: Ranks, expected: str | None) -> None:
    assert rank_namespace(None, ranks) == expected
    assert rank_namespace("lora-a", ranks) == (
        "lora-a" if expected is None else "lora-a" + expected
    )


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_page_views_match_sglang_indexing(layout: str) -> None:
    pool = HostPool(layout, pages=3, seed=5)
    host = HostLayout.of_pool(pool)
    assert (host.layer_num, host.head_num, host.head_dim, host.page_size) == (2, 2, 8, 4)
    for part in ("k", "v"):
        for layer in range(2):
            view = host.page_view(part, layer, 8)
            want = torch.stack([pool.row(part, layer, t) for t in range(8, 12)])
            assert torch.equal(view, want)
            view.copy_(want.flip(0))  # a view: writing it writes the pool
            assert torch.equal(pool.row(part, layer, 8), want[3])
    with pytest.raises(ValueError, match="does not start a page"):
        host.page_view("k", 0, 2)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_pages_views_are_every_page_view(layout: str) -> None:
    """pages_view (one copy over a batch of pages) is page_view of each page, and a view."""
    pool = HostPool(layout, pages=3, seed=6)
    host = HostLayout.of_pool(pool)
    for part in ("k", "v"):
        for layer in range(2):
            pages = host.pages_view(part, layer)
            assert pages.shape[:2] == (3, 4)
            for page in range(3):
                assert torch.equal(pages[page], host.page_view(part, layer, 4 * page))
            pages[1].zero_()
            assert not pool.row(part, layer, 5).any()


def test_unsupported_layouts_are_refused() -> None:
    pool = HostPool("page_first")
    with pytest.raises(ValueError, match="not supported"):
        HostLayout.of_buffers("page_unified", 4, pool.k_buffer, pool.v_buffer)
    with pytest.raises(ValueError, match="page dim"):
        HostLayout.of_buffers("page_first_direct", 2, torch.zeros(3, 2, 4, 2, 8), None)


class _Core:
    """Answers like a core that holds the first two pages of any chain."""

    def exists(self, keys: list[str]) -> int:
        return min(2, len(keys))

    def get(self, keys: list[str], host_indices: object) -> list[bool]:
        return [i < 2 for i in range(len(keys))]

    def set(self, keys: list[str], host_indices: object, prior: str | None) -> list[bool]:
        return [True] * len(keys)


class _Transfer:
    def __init__(self, name: str, keys: list[str]) -> None:
        self.name, self.keys, self.host_indices = name, keys, torch.zeros(0)


def test_v2_serves_the_kv_pool_and_misses_the_others() -> None:
    keys = ["a", "b", "c"]
    assert exists_v2(_Core(), keys, None) == (2, {"kv": 2}, [1, 2])
    # A pool never registered is never stored: no usable prefix, so SGLang recomputes.
    assert exists_v2(_Core(), keys, [_Transfer("mamba", keys[-1:])]) == (0, {"kv": 2}, [])
    got = transfer_v2(
        _Core(), [_Transfer("kv", keys), _Transfer("swa", keys[-1:])], None, load=True
    )
    assert got == {"kv": [True, True, False], "swa": [False]}
    assert transfer_v2(_Core(), [_Transfer("kv", keys)], None, load=False) == {"kv": [True] * 3}


def test_only_the_adapter_imports_sglang() -> None:
    """The core is engine-free: SGLang is imported by backend.py alone, and nothing in the
    package loads torch at import time (the core imports it when it moves data)."""
    from pathlib import Path

    from test_layering import imported_modules, violations

    import prefixcache.integrations.sglang as package

    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        source = path.read_text()
        sglang = violations(imported_modules(source, package.__name__), ("sglang",))
        assert (path.name == "backend.py") == bool(sglang), path.name
        eager = imported_modules(source, package.__name__, import_time_only=True)
        assert violations(eager, ("torch",)) == [], path.name

"""The documentation holds together: a short README that links every page under docs/,
links that resolve, and a configuration reference that matches the config types."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, Field, fields
from pathlib import Path

import pytest
import yaml
from doc_pages import DOCS, README, pages

from prefixcache.server.config import (
    KvEventsConfig,
    MambaConfig,
    ModelConfig,
    PoolConfig,
    RetentionConfig,
    ServerConfig,
    TenantConfig,
    load_config,
)
from prefixcache.server.config.disk import DiskConfig
from prefixcache.server.config.tier import TierConfig
from prefixcache.server.config.values import files_read_later

# The configuration reference's sections and the types they document.
REFERENCE = {
    "`server`": ServerConfig,
    "`server.kv_events`": KvEventsConfig,
    "`server.tier`": TierConfig,
    "`server.retention`": RetentionConfig,
    "`server.disk`": DiskConfig,
    "`server.tenants[]`": TenantConfig,
    "`models[]`": ModelConfig,
    "`models[].pool`": PoolConfig,
    "`models[].mamba`": MambaConfig,
}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks."""
    return re.sub(r"^ *```.*?^ *```", "", text, flags=re.DOTALL | re.MULTILINE)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    out: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", _prose(page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, anchor = 0, slug
        while anchor in out:
            n += 1
            anchor = f"{slug}-{n}"
        out.add(anchor)
    return out


def test_the_readme_is_a_short_front_door() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (README.parent / m.split("#")[0]).resolve()
        for m in LINK.findall(_prose(README.read_text()))
    }
    docs = sorted(DOCS.glob("*.md"))
    assert len(docs) >= 7
    assert [p.name for p in docs if p.resolve() not in linked] == []


def test_the_readme_names_every_switch_of_the_test_suite() -> None:
    """A new user runs the README's test command; the variables that change what it
    runs (long runs, required e2e) are named there, next to it."""
    repo = README.parent
    switches = {
        name
        for folder in ("tests", "bench")
        for path in (repo / folder).rglob("*.py")
        for name in re.findall(r'os\.environ(?:\.get\(|\[)"(PREFIXCACHE_\w+)"', path.read_text())
    }
    assert {"PREFIXCACHE_SLOW", "PREFIXCACHE_E2E"} <= switches  # the scan finds them
    readme = _prose(README.read_text())
    assert sorted(s for s in switches if s not in readme) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_link_resolves(page: Path) -> None:
    """Relative links name files that exist, and their #anchors name headings there."""
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https://..., mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert broken == [], f"{page.name}: {broken}"


def test_the_link_checker_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A `b`: c?\n\n[x](p.md#a-b-c) [y](#nope) [z](gone.md)\n")
    assert _anchors(page) == {"a-b-c"}
    with pytest.raises(AssertionError, match=r"\['#nope', 'gone.md'\]"):
        test_every_link_resolves(page)


def _reference() -> dict[str, dict[str, str]]:
    """The reference tables of docs/configuration.md: section -> {key: default cell}."""
    text = (DOCS / "configuration.md").read_text()
    out: dict[str, dict[str, str]] = {}
    for title, body in re.findall(r"^### (.*?)\n(.*?)(?=^#|\Z)", text, re.DOTALL | re.MULTILINE):
        rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", body, re.MULTILINE)
        out[title] = dict(rows)
    return out


def _default(f: Field) -> object:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return MISSING
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("title", REFERENCE)
def test_the_configuration_reference_documents_every_key(title: str) -> None:
    """Every field of the config types is documented, every documented key exists, and
    a default written as a value is the type's default (a YAML 1.1 reading: `0600` is
    octal, as in a config file)."""
    documented = _reference()[title]
    keys = [f.name for f in fields(REFERENCE[title])]
    assert sorted(documented) == sorted(keys)
    for f in fields(REFERENCE[title]):
        cell = documented[f.name]
        value = re.match(r"`([^`]*)`", cell)
        if not value:  # "required", "see below"
            assert _default(f) is MISSING or not isinstance(_default(f), (int, float, str)), (
                f.name,
                cell,
            )
            continue
        assert yaml.safe_load(value[1]) == _default(f), (title, f.name, cell)


def test_the_readme_has_an_across_nodes_section() -> None:
    """The README says how to start the shared tier (its config block loads),
    what a user sees, and what happens when the master restarts."""
    text = README.read_text()
    match = re.search(r"^## Across nodes\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE)
    assert match is not None, "README.md has no '## Across nodes' section"
    section = match.group(1)
    assert "mooncake_master" in section and "pip install '.[server,tier]'" in section
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    with files_read_later() as unread:  # the secret file is the nodes', not this host's
        tier = load_config(
            None, env={"PREFIXCACHE_TIER": json.dumps(yaml.safe_load(block)["server"]["tier"])}
        ).server.tier
    assert tier is not None and tier.master == "10.0.0.5:50051"
    assert tier.secret_file is not None and all(tier.secret_file in n for n in unread)
    prose = " ".join(_prose(section).split())
    for said in (
        "What you see",
        'tier="remote"',
        "When the master restarts",
        "the store is empty",
        "nothing fails",
    ):
        assert said in prose, said


def test_the_architecture_page_names_files_that_exist() -> None:
    """Every module or folder the architecture page's tables name (``x.py``, ``x/``)
    exists under a source root (``server/prefixcache/``, ``client/prefixcache/``) or the
    repository, so the request path and the concept table cannot drift from the code."""
    repo = README.parent
    roots = [repo, repo / "server" / "prefixcache", repo / "client" / "prefixcache"]
    rows = [
        line for line in (DOCS / "architecture.md").read_text().splitlines() if line.startswith("|")
    ]
    named = {n for row in rows for n in re.findall(r"`([\w./-]+(?:\.py|/))`", row)}
    assert len(named) > 40  # the scan finds the tables' paths
    assert sorted(n for n in named if not any((root / n).exists() for root in roots)) == []

"""No ``assert`` on the service's request path.

``python -O`` strips asserts, so one that guards a state change turns a bug into silent
corruption: the slot engine's ``assert node is not None`` let a locking
match go on with a lock on no node, after which CloseSession failed and the lease
reaper died. Checks that can fail raise an error with a status code instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prefixcache.server

SERVER = Path(prefixcache.server.__file__).parent
# Every module of the service: each one is on some call's path, from the RPC to the
# engines, the events and the tier.
MODULES = sorted(str(p.relative_to(SERVER)) for p in SERVER.rglob("*.py"))


def test_the_scan_sees_the_request_path() -> None:
    assert {
        "rpc/servicer.py",
        "service.py",
        "engine/model_engine.py",
        "sessions/session.py",
        "rpc/page_rpcs.py",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_no_assert_statements(name: str) -> None:
    path = SERVER / name
    found = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Assert)
    ]
    assert not found, f"{name}: assert on lines {found}; raise an error instead"

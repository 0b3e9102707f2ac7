"""No ``assert`` on the service's request path.

``python -O`` strips asserts, so one that guards a state change turns a bug into silent
corruption: the slot engine's ``assert node is not None`` (issue 12) let a locking
match go on with a lock on no node, after which CloseSession failed and the lease
reaper died. Checks that can fail raise an error with a status code instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prefixcache.server

SERVER = Path(prefixcache.server.__file__).parent
# Every module a cache-changing call runs through, from the RPC to the engines.
REQUEST_PATH = ("servicer.py", "servicer_ops.py", "service.py", "sessions.py",
                "engine_base.py", "engine.py", "engine_slots.py", "slot_engine.py",
                "state_slots.py",
                "slot_checks.py", "kv_transfer.py",
                "codec.py", "registration.py", "lock_audit.py", "status.py", "errors.py",
                "kv_access.py", "tenants.py", "evict_policy.py", "step.py",
                "hash_pages.py", "page_rpcs.py")


@pytest.mark.parametrize("name", REQUEST_PATH)
def test_no_assert_statements(name: str) -> None:
    path = SERVER / name
    found = [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Assert)]
    assert not found, f"{name}: assert on lines {found}; raise an error instead"

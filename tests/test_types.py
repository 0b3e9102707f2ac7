"""The type check's baseline rule (scripts/check_types.py), on mypy output written here;
CI runs the check itself over the tree (.ci/run)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_types", REPO / "scripts/check_types.py")
assert _spec is not None and _spec.loader is not None
check_types = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_types)

OUTPUT = """\
server/prefixcache/server/app.py:12: error: Item "None" of "X | None" has no attr "y"  [union-attr]
server/prefixcache/server/app.py:40:7: error: Item "None" of "Z|None" has no attr "w"  [union-attr]
server/prefixcache/server/app.py:40: note: See https://mypy.readthedocs.io for more
client/prefixcache/integrations/vllm/worker.py:3: error: Missing return statement  [empty-body]
Found 3 errors in 2 files (checked 194 source files)
"""


def test_errors_are_read_without_line_numbers_or_notes() -> None:
    errors = check_types.errors_of(OUTPUT)
    assert errors == [
        "client/prefixcache/integrations/vllm/worker.py: error: Missing return statement"
        "  [empty-body]",
        'server/prefixcache/server/app.py: error: Item "None" of "X | None" has no '
        'attr "y"  [union-attr]',
        'server/prefixcache/server/app.py: error: Item "None" of "Z|None" has no '
        'attr "w"  [union-attr]',
    ]
    assert check_types.counts(errors) == {
        ("client/prefixcache/integrations/vllm/worker.py", "empty-body"): 1,
        ("server/prefixcache/server/app.py", "union-attr"): 2,
    }


def test_a_new_error_fails_and_a_fixed_one_must_leave_the_baseline() -> None:
    """Counts per file and code: moving code (other line numbers, other messages of
    the same code) passes; one error more fails; one fewer asks for the update."""
    baseline = check_types.errors_of(OUTPUT)
    moved = check_types.errors_of(OUTPUT.replace(":12:", ":99:").replace('"y"', '"v"'))
    assert check_types.compare(moved, baseline) == ([], [])
    more = check_types.errors_of(
        OUTPUT + "server/prefixcache/server/app.py:5: error: Bad  [union-attr]\n"
    )
    assert check_types.compare(more, baseline) == (
        ["server/prefixcache/server/app.py [union-attr] (+1)"],
        [],
    )
    fewer = baseline[:1] + baseline[2:]
    assert check_types.compare(fewer, baseline) == (
        [],
        ["server/prefixcache/server/app.py [union-attr] (-1)"],
    )


def test_the_baseline_is_the_checker_s_own_format() -> None:
    """Every line reads back as an error the comparison counts (a hand-edited line
    that it could not parse would count as nothing)."""
    entries = check_types.read_baseline()
    assert entries == sorted(entries)
    rebuilt = [
        f"{e.split(': error: ', 1)[0]}:1: error: {e.split(': error: ', 1)[1]}" for e in entries
    ]
    assert check_types.errors_of("\n".join(rebuilt)) == entries


def test_the_cache_and_the_client_are_checked_strictly() -> None:
    """The strict options cover both packages (the rest is held to the baseline)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = [o for o in config["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1
    assert {"prefixcache.cache.*", "prefixcache.client.*"} <= set(strict[0]["module"])
    assert strict[0]["warn_return_any"] and strict[0]["disallow_any_generics"]

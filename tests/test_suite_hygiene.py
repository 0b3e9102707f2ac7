"""The suite stays fast feedback that a loaded machine cannot fail: no test asserts an
upper bound on a duration it measured.

An assert such as ``assert time.monotonic() - t0 < 1.0`` fails on a busy shared machine
and passes on a fast one without showing the property it stands for. A test asserts
that property instead: that the call came back (a generous deadline on the wait bounds
the test, it claims no speed), the error code of a deadline that fired, an ordering
(another client was answered while the slow call was still held), or a counter. Speed
is measured in ``bench/``, as ratios within one run.

The rule this test enforces, over every ``.py`` file under ``tests/``: an ``assert``
(or an ``if`` whose body calls ``pytest.fail``) may not hold a comparison that bounds
from above a *measured duration*, which is any of

* a difference with a clock reading on either side: ``time.monotonic()``,
  ``time.perf_counter()``, ``time.time()`` (and their ``_ns`` forms), ``loop.time()``;
* a name (or attribute) assigned, appended or extended in the same module from an
  expression that holds one (``took = time.monotonic() - start``,
  ``slowest = max(slowest, ...)``, ``self.latencies.append(...)``), transitively;
* a name that says it is one: ``elapsed``, ``took``, ``duration``, ``wall``,
  ``latency``/``latencies``, ``slowest`` (as a word of a snake_case name).

What stays allowed, because a loaded machine cannot fail it:

* a polling deadline, ``assert time.monotonic() < deadline, "never ..."``: a clock
  reading against an absolute time, not a duration; it bounds a wait;
* a lower bound, ``assert took >= GRACE``: load only makes a wait longer, so it fails
  only when the code did not wait (a drain that did not drain);
* ``len(...)`` of a list of durations (a count), and CPU time of one thread
  (``time.thread_time()``), which other processes' load does not stretch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_CLOCKS = {"monotonic", "perf_counter", "monotonic_ns", "perf_counter_ns"}
_WALL = {"time", "time_ns"}  # only as time.time() or a loop's .time()
_NAMED = re.compile(
    r"(?:^|_)(elapsed|took|duration|durations|wall|latency|latencies|slowest)(?:_|$)"
)
_UPPER = (ast.Lt, ast.LtE)
_LOWER_LEFT = (ast.Gt, ast.GtE)


def _is_clock(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in _CLOCKS
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in _CLOCKS:
        return True
    if func.attr in _WALL:
        owner = func.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        return name == "time" or "loop" in name
    return False


def _contains_clock(node: ast.AST) -> bool:
    return any(_is_clock(n) for n in ast.walk(node))


def _target_names(node: ast.AST) -> list[str]:
    """The names ``node`` assigns: ``x`` for a variable, ``.x`` for an attribute (kept
    apart, so that ``watch.worst`` is not the ``worst`` of another line)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [f".{node.attr}"]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for elt in node.elts for n in _target_names(elt)]
    return []


class _Durations:
    """What in one module measures a duration."""

    def __init__(self, tree: ast.Module) -> None:
        self.tainted: set[str] = set()
        changed = True
        while changed:  # to a fixed point: a duration assigned from a duration
            changed = False
            for node in ast.walk(tree):
                for name, value in self._flows(node):
                    if name not in self.tainted and self.measures(value):
                        self.tainted.add(name)
                        changed = True

    @staticmethod
    def _flows(node: ast.AST) -> list[tuple[str, ast.AST]]:
        """(name, value) for each name ``node`` gives a value to."""
        if isinstance(node, ast.Assign):
            targets = [n for t in node.targets for n in _target_names(t)]
            if isinstance(node.value, ast.Tuple) and any(
                isinstance(t, ast.Tuple) for t in node.targets
            ):
                # a, b = x, y: each name its own value
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and len(target.elts) == len(node.value.elts):
                        for elt, value in zip(target.elts, node.value.elts, strict=True):
                            pairs += [(n, value) for n in _target_names(elt)]
                return pairs
            return [(n, node.value) for n in targets]
        if isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
            return [(n, node.value) for n in _target_names(node.target)]
        if isinstance(node, ast.NamedExpr):
            return [(node.target.id, node.value)]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "insert", "add")
        ):
            return [(n, arg) for n in _target_names(node.func.value) for arg in node.args]
        return []

    def measures(self, node: ast.AST) -> bool:
        """Whether ``node`` holds a measured duration (not under ``len(...)``)."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
            return False
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Sub)
            and (_contains_clock(node.left) or _contains_clock(node.right))
        ):
            return True
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            key = node.id if isinstance(node, ast.Name) else f".{node.attr}"
            if key in self.tainted or _NAMED.search(name):
                return True
        return any(self.measures(child) for child in ast.iter_child_nodes(node))

    def upper_bounds(self, test: ast.AST, failing: bool = False) -> bool:
        """Whether ``test`` bounds a measured duration from above (``failing``: it is
        the condition under which the test fails, so its bound is the reverse)."""
        upper, lower = (_LOWER_LEFT, _UPPER) if failing else (_UPPER, _LOWER_LEFT)
        for node in ast.walk(test):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides[:-1], sides[1:], strict=True):
                if isinstance(op, upper) and self.measures(left):
                    return True
                if isinstance(op, lower) and self.measures(right):
                    return True
        return False


def _fails(body: list[ast.stmt]) -> bool:
    for stmt in body:
        for node in ast.walk(stmt):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "fail"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "pytest"
            ):
                return True
    return False


def wall_clock_asserts(source: str) -> list[int]:
    """The lines of ``source`` that assert an upper bound on a measured duration."""
    tree = ast.parse(source)
    durations = _Durations(tree)
    lines = []
    for node in ast.walk(tree):
        asserted = isinstance(node, ast.Assert) and durations.upper_bounds(node.test)
        failed = (
            isinstance(node, ast.If)
            and _fails(node.body)
            and durations.upper_bounds(node.test, failing=True)
        )
        if asserted or failed:
            lines.append(node.lineno)
    return sorted(lines)


def test_no_test_asserts_an_upper_bound_on_wall_clock_time() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for line in wall_clock_asserts(path.read_text()):
            text = path.read_text().splitlines()[line - 1].strip()
            offenders.append(f"{path.relative_to(TESTS.parent)}:{line}: {text}")
    assert offenders == [], "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        "assert time.monotonic() - t0 < 1.0",
        "assert 0.2 < time.monotonic() - t0 < 3.0",
        "assert 2.0 > time.perf_counter() - start",
        "assert abs(ts - time.time()) < 600",
        "took = time.monotonic() - start\nassert took < TIMEOUT + MARGIN, took",
        "slowest = 0.0\nslowest = max(slowest, time.monotonic() - s)\nassert slowest < 1",
        "took = []\ntook.append(time.monotonic() - t0)\nassert took[-1] < 1.0",
        "self.latencies.append(perf_counter() - s)\nworst = max(v.latencies)\nassert worst < 2",
        "assert elapsed <= 5",
        "if time.monotonic() - start > 3:\n    pytest.fail('slow')",
        "assert loop.time() - t < 0.1",
        "w.worst = 0.0\nw.worst = max(w.worst, monotonic() - s)\nassert w.worst < 1",
    ],
)
def test_the_rule_flags_an_upper_bound_on_a_measured_duration(source: str) -> None:
    checks = [
        n for n, line in enumerate(source.splitlines(), 1) if line.startswith(("assert", "if"))
    ]
    assert wall_clock_asserts(source) == checks, source


@pytest.mark.parametrize(
    "source",
    [
        "assert time.monotonic() < deadline, 'the lease never lapsed'",
        "left = deadline - time.monotonic()\nassert left > 0 and sock.poll(int(left * 1000))",
        "took = time.monotonic() - hup_at\nassert took >= GRACE * 0.9",
        "assert time.monotonic() - t0 >= 0.95",
        "took = []\ntook.append(time.monotonic() - t0)\nassert len(took) > 20",
        "spent = time.thread_time() - s\nassert spent < 0.1",
        "assert until > time.time()",
        "while time.monotonic() - start < 10:\n    pass",
        "whole, worst = cosine(a, b)\nassert worst < 0.99",
        "worst = max(worst, time.perf_counter() - s)\nassert watch.worst < HELD",
    ],
)
def test_the_rule_leaves_deadlines_lower_bounds_and_counts_alone(source: str) -> None:
    assert wall_clock_asserts(source) == [], source

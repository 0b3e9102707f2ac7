"""Just enough PromQL reading to check which metrics and labels an expression uses.

No PromQL parser or promtool installs from the package registries here, so this is a
small tokenizer: it finds the selectors (metric name and label matchers), the grouping
labels (``by``, ``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``) and
the functions called, and rejects what it does not know (an unknown function is as
likely a typo as an unknown metric). Grafana's ``$variables`` are accepted where Grafana
puts them: in range brackets and inside label values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FUNCTIONS = frozenset(
    {
        "abs",
        "absent",
        "avg",
        "avg_over_time",
        "bottomk",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "count",
        "count_over_time",
        "delta",
        "deriv",
        "floor",
        "group",
        "histogram_quantile",
        "idelta",
        "increase",
        "irate",
        "label_replace",
        "last_over_time",
        "max",
        "max_over_time",
        "min",
        "min_over_time",
        "quantile",
        "quantile_over_time",
        "rate",
        "resets",
        "round",
        "scalar",
        "sort",
        "sort_desc",
        "stddev",
        "sum",
        "sum_over_time",
        "time",
        "topk",
        "vector",
    }
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
OPERATORS = frozenset({"and", "or", "unless", "bool", "offset"})

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?[a-z]*")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass
class Selector:
    metric: str
    matchers: list[Matcher] = field(default_factory=list)


@dataclass
class Expr:
    """What one expression refers to."""

    text: str
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)

    @property
    def metrics(self) -> set[str]:
        return {s.metric for s in self.selectors}


class PromQLError(ValueError):
    pass


def parse(text: str) -> Expr:
    """The selectors, grouping labels and functions of one PromQL expression."""
    expr = Expr(text)
    depth = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace() or c in ",+-*/^%<>=!":
            i += 1
        elif c == "(":
            depth += 1
            i += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise PromQLError(f"unbalanced ')' at {i} in {text!r}")
            i += 1
        elif c == "[":
            end = text.find("]", i)
            if end < 0:
                raise PromQLError(f"unclosed '[' in {text!r}")
            _check_range(text[i + 1 : end], text)
            i = end + 1
        elif c == "{":
            raise PromQLError(f"a selector without a metric name in {text!r}")
        elif c == '"':
            raise PromQLError(f"a string outside a label matcher in {text!r}")
        elif (m := _NUMBER.match(text, i)) and (c.isdigit() or c == "."):
            i = m.end()
        elif m := _IDENT.match(text, i):
            word, i = m.group(), m.end()
            i = _after_word(text, i, word, expr)
        else:
            raise PromQLError(f"unexpected {c!r} at {i} in {text!r}")
    if depth:
        raise PromQLError(f"unbalanced '(' in {text!r}")
    return expr


def _after_word(text: str, i: int, word: str, expr: Expr) -> int:
    j = _skip_space(text, i)
    nxt = text[j] if j < len(text) else ""
    if word in GROUPING:
        if nxt != "(":
            if word in ("group_left", "group_right"):
                return i
            raise PromQLError(f"{word} without a label list in {expr.text!r}")
        end = text.index(")", j)
        labels = [s.strip() for s in text[j + 1 : end].split(",") if s.strip()]
        for label in labels:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", label):
                raise PromQLError(f"bad label {label!r} in {word}(...) of {expr.text!r}")
        expr.grouping.update(labels)
        return end + 1
    if word in OPERATORS:
        return i
    if word in FUNCTIONS:
        expr.functions.add(word)
        return i
    if nxt == "(":
        raise PromQLError(f"unknown function {word}() in {expr.text!r}")
    selector = Selector(word)
    expr.selectors.append(selector)
    if nxt == "{":
        end = text.find("}", j)
        if end < 0:
            raise PromQLError(f"unclosed '{{' in {expr.text!r}")
        body, pos = text[j + 1 : end], 0
        while pos < len(body):
            m = _MATCHER.match(body, pos)
            if not m or m.end() == pos:
                raise PromQLError(f"bad label matcher {body[pos:]!r} in {expr.text!r}")
            selector.matchers.append(Matcher(*m.groups()))
            pos = m.end()
        return end + 1
    return i


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _check_range(inner: str, text: str) -> None:
    if not re.fullmatch(r"\s*(\$\w+|\d+[smhdwy](\d+[smhdwy])*)(:(\$\w+|\d+[smhdwy]))?\s*", inner):
        raise PromQLError(f"bad range [{inner}] in {text!r}")

"""Control flow written once for the blocking and the asyncio client.

A flow is a generator that decides; a driver does the waiting. The flow yields its next
step, a callable taking no arguments or a :class:`Pause`, and is sent back the step's
result or thrown its exception. :func:`run_blocking` calls the step and sleeps with
``time``; :func:`run_async` awaits what the step returns and sleeps with ``asyncio``.
So a retry loop, or a session's recovery from a lost service-side session, exists once
and the two clients cannot drift apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Pause:
    """A step that waits ``seconds`` (a retry's backoff)."""

    seconds: float


Step = Callable[[], Any] | Pause
Flow = Generator[Step, Any, T]


class _Driver:
    """Feeds a flow its steps' results and errors; the drivers below only run steps."""

    def __init__(self, flow: Flow[Any]) -> None:
        self._flow = flow
        self._error: Exception | None = None
        self.value: Any = None  # the last step's result; at the end, the flow's

    def next_step(self) -> Step | None:
        """The flow's next step, or None once it has returned (its answer in ``value``)."""
        try:
            if self._error is not None:
                error, self._error = self._error, None
                return self._flow.throw(error)
            return self._flow.send(self.value)
        except StopIteration as done:
            self.value = done.value
            return None

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around one step: its exception goes to the flow, which decides."""
        try:
            yield
        except Exception as exc:
            self._error = exc


def run_blocking(flow: Flow[T]) -> T:
    """Run ``flow``, calling each step (and sleeping through each pause) in turn."""
    driver = _Driver(flow)
    while (step := driver.next_step()) is not None:
        with driver.running():
            if isinstance(step, Pause):
                time.sleep(step.seconds)
                driver.value = None
            else:
                driver.value = step()
    answer: T = driver.value  # what the flow returned
    return answer


async def run_async(flow: Flow[T]) -> T:
    """Run ``flow``, awaiting what each step returns (and each pause) in turn."""
    driver = _Driver(flow)
    while (step := driver.next_step()) is not None:
        with driver.running():
            driver.value = await (
                asyncio.sleep(step.seconds) if isinstance(step, Pause) else step()
            )
    answer: T = driver.value  # what the flow returned
    return answer

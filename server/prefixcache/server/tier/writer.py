"""The put queue: pages on their way to the store, written by one thread of their own.

Nothing waits on a write: the event loop hands a job over (``offer``) and goes on; a
full queue refuses the job, and the caller counts the drop. The thread takes up to
``batch_jobs`` jobs at once, seals their pages (each job's ``seal``: the pages' seals
into their seal slots, seals.py) and stores them in one batch call per store (a job's
``put``: Mooncake's one client, or each model's disk store; a batch of which some job
carries a retention, ``PutJob.retain``, is put with each page's as a fourth argument),
then hands each job's answer back to the loop (``done``, called there), which releases
the pages and seal slots the job pinned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backend import PageRetention, Parts

log = logging.getLogger("prefixcache.server")

# Jobs waiting at most (one more is a counted drop), and jobs one batch call stores.
MAX_JOBS = 64
BATCH_JOBS = 16


@dataclass(slots=True)
class PutJob:
    """Pages to store: keys and parts, what to run on the thread before they are
    stored (their seals), and what to call on the loop once stored (with one code per
    key; an empty list when the call itself, or the sealing, failed)."""

    keys: list[str]
    ptrs: Parts
    sizes: Parts
    done: Callable[[list[int]], None]
    # Seals the pages; False: they are not to be stored (answered with no codes).
    seal: Callable[[], bool] | None = None
    # The store's batch put (None: the queue's); jobs with equal ones share a call.
    put: Callable[..., list[int]] | None = None
    # The retention of every page of the job, for a store that keeps it (None: none).
    retain: PageRetention | None = None


class PutQueue:
    """A bounded queue of put jobs and the thread that stores them.

    Args:
        put: The backend's batch put (blocking; or raise) for jobs without their own.
        call_soon: Runs a callable on the event loop (``loop.call_soon_threadsafe``).
        max_jobs: Jobs waiting at most; one more is refused.
        batch_jobs: Jobs stored by one batch call at most.
    """

    def __init__(
        self,
        put: Callable[[list[str], Parts, Parts], list[int]] | None,
        call_soon: Callable[..., Any],
        max_jobs: int = MAX_JOBS,
        batch_jobs: int = BATCH_JOBS,
    ) -> None:
        self._put = put
        self._call_soon = call_soon
        self.max_jobs = max_jobs
        self._batch = batch_jobs
        self._jobs: deque[PutJob] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.busy = 0  # jobs taken by the thread, not yet answered
        self._thread = threading.Thread(target=self._run, name="prefixcache-tier-put", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting or being written."""
        return len(self._jobs) + self.busy

    def has_room(self, jobs: int = 1) -> bool:
        """Whether ``jobs`` more would be queued now (only the loop offers, so the
        answer holds until it offers: the thread only takes jobs out)."""
        return not self._closed and len(self._jobs) + jobs <= self.max_jobs

    def offer(self, job: PutJob) -> bool:
        """Queue ``job``; False (nothing queued) when the queue is full or closed."""
        with self._cv:
            if self._closed or len(self._jobs) >= self.max_jobs:
                return False
            self._jobs.append(job)
            self._cv.notify()
        return True

    def close(self, timeout: float = 5.0) -> list[PutJob]:
        """Stop the thread (after the batch in hand); returns the jobs never written."""
        with self._cv:
            self._closed = True
            left = list(self._jobs)
            self._jobs.clear()
            self._cv.notify()
        self._thread.join(timeout)
        return left

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch = [self._jobs.popleft() for _ in range(min(self._batch, len(self._jobs)))]
                self.busy = len(batch)
            sealed: list[PutJob] = []
            failed: list[PutJob] = []
            for job in batch:
                try:
                    (sealed if job.seal is None or job.seal() else failed).append(job)
                except Exception:  # a job that cannot be sealed is not stored
                    log.exception("tier put: sealing failed")
                    failed.append(job)
            answers: list[tuple[PutJob, list[int]]] = [(job, []) for job in failed]
            while sealed:
                put = sealed[0].put or self._put
                mine = [job for job in sealed if (job.put or self._put) == put]
                sealed = [job for job in sealed if (job.put or self._put) != put]
                answers.extend(self._store(put, mine))
            for job, codes in answers:
                with contextlib.suppress(RuntimeError):  # the loop is closed: server gone
                    self._call_soon(job.done, codes)
            with self._cv:
                self.busy = 0

    def _store(
        self, put: Callable[..., list[int]] | None, jobs: list[PutJob]
    ) -> list[tuple[PutJob, list[int]]]:
        """Store ``jobs`` with one call of ``put``; each job with its codes."""
        keys = [k for job in jobs for k in job.keys]
        ptrs = [p for job in jobs for p in job.ptrs]
        sizes = [s for job in jobs for s in job.sizes]
        retain = [job.retain for job in jobs for _ in job.keys]
        try:
            if not keys or put is None:
                codes = []
            elif any(r is not None for r in retain):
                codes = put(keys, ptrs, sizes, retain)
            else:
                codes = put(keys, ptrs, sizes)
        except Exception:  # a backend bug must not end the thread
            log.exception("tier put failed")
            codes = []
        answers, at = [], 0
        for job in jobs:
            n = len(job.keys)
            answers.append((job, codes[at : at + n] if len(codes) == len(keys) else []))
            at += n
        return answers

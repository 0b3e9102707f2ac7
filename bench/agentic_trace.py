"""A synthetic agentic trace: agent sessions of many turns whose prompts grow by tool
output, subagents forking a session's prefix, and one-off prompts between them.

The parameters (``AgentParams``) and their sources are listed in capacity.py's
docstring. Prompts are chains of blocks of ``BLOCK`` tokens (a block id stands for its
tokens, as a Mooncake hash id stands for 512), so a 180 K-token context is a key of
about 2,800 ids. A chain is an ``array('I')`` that grows; a request names a prefix of
one, so the trace holds each context once.
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass, field

BLOCK = 64

TURN, ONE_OFF, RELEASE = "turn", "one_off", "release"


@dataclass(frozen=True)
class AgentParams:
    """What the trace is made of; capacity.py's docstring gives the sources."""

    sessions: int = 160
    arrival_s: float = 3600.0  # sessions start at uniform random times in this window
    turns_median: float = 38.0  # per session; lognormal
    turns_sigma: float = 0.5
    system_tokens: int = 12_000  # tools and system prompt, shared by sessions of a kind
    system_kinds: int = 4
    first_prompt_tokens: tuple[int, int] = (1_000, 4_000)  # uniform
    turn_tokens_median: float = 1_500.0  # tool output + model output per turn; lognormal
    turn_tokens_sigma: float = 0.9
    turn_tokens_clip: tuple[int, int] = (200, 8_000)
    context_cap: int = 180_000  # past it the session compacts: system + a summary
    summary_tokens: int = 4_000
    tool_gap_mean_s: float = 6.0  # model + tool time between turns; exponential
    human_gap_share: float = 0.12  # turns that wait for a person
    human_gap_median_s: float = 180.0  # lognormal
    human_gap_sigma: float = 0.8
    human_gap_clip: tuple[float, float] = (30.0, 1_800.0)
    subagent_share: float = 0.44  # sessions that fork subagents (once)
    subagents: tuple[int, int] = (1, 3)
    subagent_turns_median: float = 8.0
    subagent_task_tokens: tuple[int, int] = (500, 2_000)
    subagent_result_tokens: int = 1_000
    one_off_share: float = 0.3  # of all requests: one-off prompts, no reuse, no hint
    one_off_tokens_median: float = 8_000.0
    one_off_tokens_sigma: float = 0.7
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    """One event: a prompt (``TURN`` of an agent, or a ``ONE_OFF``), or the end of an
    agent chain (``RELEASE``: the client says its prefix no longer matters)."""

    t: float
    kind: str
    chain: array
    length: int  # blocks of ``chain`` in the prompt

    def blocks(self) -> array:
        return self.chain[: self.length]


@dataclass
class _Gen:
    p: AgentParams
    rng: random.Random
    next_id: int = 1
    out: list[Request] = field(default_factory=list)

    def fresh(self, tokens: float) -> array:
        n = max(1, round(tokens / BLOCK))
        ids = array("I", range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def lognormal(self, median: float, sigma: float) -> float:
        return median * math.exp(self.rng.gauss(0.0, sigma))

    def turn_tokens(self) -> float:
        lo, hi = self.p.turn_tokens_clip
        return min(hi, max(lo, self.lognormal(self.p.turn_tokens_median, self.p.turn_tokens_sigma)))

    def gap(self, humans: bool = True) -> float:
        p = self.p
        if humans and self.rng.random() < p.human_gap_share:
            lo, hi = p.human_gap_clip
            return min(hi, max(lo, self.lognormal(p.human_gap_median_s, p.human_gap_sigma)))
        return self.rng.expovariate(1.0 / p.tool_gap_mean_s)

    def run(
        self,
        chain: array,
        t: float,
        turns: int,
        system: array,
        *,
        humans: bool = True,
        fork_at: int | None = None,
    ) -> tuple[array, float]:
        """An agent's turns from time ``t`` on ``chain``; returns its last chain and
        the time after its last turn."""
        p = self.p
        for turn in range(turns):
            self.out.append(Request(t, TURN, chain, len(chain)))
            if turn == fork_at:
                t = self.fork(chain, t)
                chain.extend(self.fresh(p.subagent_result_tokens))
            chain.extend(self.fresh(self.turn_tokens()))
            if len(chain) * BLOCK > p.context_cap:  # compaction: the old chain is done
                self.out.append(Request(t, RELEASE, chain, len(chain)))
                chain = array("I", system)
                chain.extend(self.fresh(p.summary_tokens))
            t += self.gap(humans)
        return chain, t

    def fork(self, parent: array, t: float) -> float:
        """Subagents on the parent's prefix, concurrently; the parent waits for them."""
        p = self.p
        end = t
        for _ in range(self.rng.randint(*p.subagents)):
            chain = array("I", parent)
            chain.extend(self.fresh(self.rng.uniform(*p.subagent_task_tokens)))
            turns = max(2, round(self.lognormal(p.subagent_turns_median, p.turns_sigma)))
            start = t + self.rng.uniform(0.0, 2.0)
            chain, done = self.run(chain, start, turns, parent, humans=False)
            self.out.append(Request(done, RELEASE, chain, len(chain)))
            end = max(end, done)
        return end


def agentic_trace(p: AgentParams) -> list[Request]:
    """The trace's events in time order (ties in the order they were made)."""
    g = _Gen(p, random.Random(p.seed))
    systems = [g.fresh(p.system_tokens) for _ in range(p.system_kinds)]
    for _ in range(p.sessions):
        system = systems[g.rng.randrange(len(systems))]
        chain = array("I", system)
        chain.extend(g.fresh(g.rng.uniform(*p.first_prompt_tokens)))
        turns = max(2, round(g.lognormal(p.turns_median, p.turns_sigma)))
        fork_at = g.rng.randint(1, turns - 1) if g.rng.random() < p.subagent_share else None
        chain, t = g.run(chain, g.rng.uniform(0.0, p.arrival_s), turns, system, fork_at=fork_at)
        g.out.append(Request(t, RELEASE, chain, len(chain)))
    turns = sum(1 for r in g.out if r.kind == TURN)
    end = max(r.t for r in g.out)
    if 0 < p.one_off_share < 1:
        for _ in range(round(turns * p.one_off_share / (1 - p.one_off_share))):
            chain = g.fresh(g.lognormal(p.one_off_tokens_median, p.one_off_tokens_sigma))
            g.out.append(Request(g.rng.uniform(0.0, end), ONE_OFF, chain, len(chain)))
    order = sorted(range(len(g.out)), key=lambda i: g.out[i].t)
    return [g.out[i] for i in order]

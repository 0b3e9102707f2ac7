"""The server ``load.py`` runs against, its models of every kind, and their Stats.

``load.py`` replays the trace against a radix model; this module starts the server
with that model and one small model of each other kind (``swa``, ``mamba``, ``slot``,
``chunk``), reads every model's Stats at the end, and makes the request a worker sends
to the other kinds between its radix request's insert and unlock:

* keys come from a few shared prefixes with random tails, so matches hit;
* ``swa`` and ``mamba``: match(lock, allocate) -> insert(release_lock_id, lock) ->
  unlock. The SWA pool is a quarter of the full one, and the Mamba model has only
  ``3 x workers + 4`` state slots, so SWA windows and Mamba states are evicted under
  pressure all the time (every new prefix needs a state);
* ``slot``: as examples/worker.py does it: match(lock, allocate) -> insert(lock,
  release_lock_id) -> a second insert with the "generated" tokens -> free. The pool
  has ``workers + 2`` sequence slots, so a prefix is often found in a slot its owner
  freed and reused in place, and otherwise copied;
* ``chunk``: match(allocate) -> insert (caches nothing) -> free;
* one request in four first names the radix request's lock as ``release_lock_id``
  of the other model's insert: the service must refuse it (FAILED_PRECONDITION) and
  change nothing; the real insert follows.

Outcomes that are expected, not errors, are counted in ``counts``: refused cross-model
releases, slots reused in place, slots copied.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from bench.grpc_servers import MODEL, ServerProcess

# `python -m prefixcache.server.cli` does not run main(): the module has no __main__ guard.
_SERVE = "import sys; from prefixcache.server.cli import main; sys.exit(main())"

KINDS = ("swa", "mamba", "slot", "chunk")
SLOT_MAX_SEQ_LEN = 64
_PREFIXES = 24  # families of shared prefixes
_SIDE_POOL = 4096  # tokens in each of the swa, mamba and chunk pools


def models_yaml(workers: int) -> str:
    """The ``models:`` entries of the side models, for a server config."""
    kv = "layers: 1, k_heads: 1, k_head_dim: 8, dtype: float16"
    return (
        f"  - name: swa\n    kind: swa\n    page_size: 1\n    sliding_window_size: 16\n"
        f"    pool: {{size: {_SIDE_POOL}, swa_size: {_SIDE_POOL // 4}, {kv}}}\n"
        f"  - name: mamba\n    kind: mamba\n    page_size: 1\n"
        f"    pool: {{size: {_SIDE_POOL}, {kv}}}\n"
        f"    mamba: {{state_slots: {3 * workers + 4}, layers: 1}}\n"
        f"  - name: slot\n    kind: slot\n    max_seq_len: {SLOT_MAX_SEQ_LEN}\n"
        f"    pool: {{size: {workers + 2}, {kv}}}\n"
        f"  - name: chunk\n    kind: chunk\n    page_size: 1\n"
        f"    pool: {{size: {_SIDE_POOL}, {kv}}}\n"
    )


def _model_stats(m: Any) -> dict[str, Any]:
    return {
        "locks": m.locks,
        "session_slots": m.session_slots,
        "session_state_slots": m.session_state_slots,
        "free_slots": m.free_slots,
        "pool_size": m.pool_size,
        "cached_tokens": m.evictable_tokens + m.protected_tokens,
        "protected_tokens": m.protected_tokens,
        "evicted_tokens": m.evicted_tokens_total,
        "match_tokens": m.match_tokens_total,
        "hit_ratio": m.hit_tokens_total / m.match_tokens_total if m.match_tokens_total else 0.0,
    }


def final_stats(target: str) -> dict[str, Any]:
    """The radix model's Stats at the top level, every model's under ``models``."""
    from prefixcache.client import PrefixCacheClient

    with PrefixCacheClient(target, timeout=30) as client:
        reply = client.stats()
    models = {m.model: _model_stats(m) for m in reply.models}
    return {**models[MODEL], "sessions": reply.sessions, "models": models}


def held_after(stats: dict[str, Any]) -> list[str]:
    """What any model still holds once every session has gone."""
    return [
        f"{name}: {key} {s[key]}"
        for name, s in stats["models"].items()
        for key in ("locks", "session_slots", "session_state_slots", "protected_tokens")
        if s[key]
    ]


def start_service(tmp: Path, args: Any) -> ServerProcess:
    """``prefixcache serve``: the radix model of the trace, and the side models."""
    config = tmp / "load.yaml"
    config.write_text(
        f"models:\n  - name: {MODEL}\n    kind: radix\n    page_size: {args.page_size}\n"
        f"    pool: {{size: {args.budget}, layers: 1, k_heads: 1, k_head_dim: 8, "
        "dtype: float16}\n" + (models_yaml(args.workers) if args.side_every else "")
    )
    argv = [
        sys.executable,
        "-c",
        _SERVE,
        "serve",
        "--config",
        str(config),
        "--listen",
        f"unix:{tmp / 'pc.sock'}",
        "--metrics-port",
        "-1",
        "--grace-period",
        "1",
        "--log-level",
        "warning",
        *(["--check-integrity"] if args.check_integrity else []),
    ]
    return ServerProcess("prefixcache serve", argv, tmp / "pc.sock", tmp / "server-load.log")


def side_key(rng: random.Random) -> list[int]:
    """One of a few shared prefixes (8..31 tokens) and a random tail (0..23 tokens)."""
    family = rng.randrange(_PREFIXES)
    prefix = [100_000 + 1_000 * family + j for j in range(8 + family)]
    return prefix + [rng.randrange(1, 50_000) for _ in range(rng.randrange(24))]


class SideRequests:
    """One worker's requests on the side models, taking turns.

    Args:
        index: the worker's index (seeds its keys and its first turn).
        error: ``error(op, exc)`` records a failed call.
        counts: expected outcomes by name, added to.
    """

    def __init__(self, index: int, error: Any, counts: dict[str, int]) -> None:
        self.rng = random.Random(index)
        self.error = error
        self.counts = counts
        self.turn = index

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def run(self, session: Any, foreign_lock: int) -> str:
        """One request on the next side model; ``foreign_lock`` is a lock the session
        holds on another model (0: none). Returns the model's kind."""
        from prefixcache.client import PrefixCacheError

        kind = KINDS[self.turn % len(KINDS)]
        self.turn += 1
        key = side_key(self.rng)
        foreign = foreign_lock if foreign_lock and self.rng.randrange(4) == 0 else 0
        flow = {
            "swa": self._radix_like,
            "mamba": self._radix_like,
            "slot": self._slot,
            "chunk": self._chunk,
        }[kind]
        held: list[int] = []  # lock ids to release on error
        owned: list[Any] = []  # slot arrays to free on error
        try:
            flow(session, kind, key, held, owned, foreign)
        except PrefixCacheError as err:
            self.error(kind, err)
            try:
                for slots in owned:
                    if len(slots):
                        session.free(kind, slots)
                for lock_id in held:
                    if lock_id:
                        session.unlock(lock_id)
            except PrefixCacheError as undo:
                self.error(f"{kind} undo", undo)
        return kind

    def _refused_release(
        self,
        session: Any,
        model: str,
        key: list[int],
        slots: Any,
        lock_id: int,
        held: list[int],
        **kwargs: Any,
    ) -> None:
        """An insert naming another model's lock: it must be refused, changing nothing."""
        from prefixcache.client import FailedPrecondition

        try:
            wrong = session.insert(model, key, slots, release_lock_id=lock_id, lock=True, **kwargs)
        except FailedPrecondition:
            self._count("cross-model release_lock_id refused")
            return
        held.append(wrong.lock_id)  # the regression took a lock: release it on error
        self.error(
            f"{model} cross-model release",
            RuntimeError(f"an insert releasing another model's lock {lock_id} was accepted"),
        )

    def _radix_like(
        self,
        session: Any,
        model: str,
        key: list[int],
        held: list[int],
        owned: list[Any],
        foreign: int,
    ) -> None:
        m = session.match(model, key, lock=True, allocate=True)
        held.append(m.lock_id)
        owned.append(m.allocated)
        state = {"state_slot": m.allocated_state_slot} if m.allocated_state_slot is not None else {}
        if foreign:
            self._refused_release(session, model, key, m.all_slots(), foreign, held, **state)
        ins = session.insert(
            model, key, m.all_slots(), release_lock_id=m.lock_id, lock=True, **state
        )
        held[:] = [ins.lock_id]
        owned.clear()
        if ins.lock_id:
            session.unlock(ins.lock_id)
        held.clear()

    def _slot(
        self,
        session: Any,
        model: str,
        key: list[int],
        held: list[int],
        owned: list[Any],
        foreign: int,
    ) -> None:
        prompt = key[: SLOT_MAX_SEQ_LEN - 8]
        m = session.match(model, prompt, lock=True, allocate=True)
        held.append(m.lock_id)
        owned.append(m.allocated)
        if m.prefix_len:
            self._count(
                "slot reused in place" if list(m.allocated) == list(m.slots) else "slot copied"
            )
        version = m.allocated_slot_version or 0
        if foreign:
            self._refused_release(
                session, model, prompt, m.allocated, foreign, held, slot_version=version
            )
        prefill = session.insert(
            model, prompt, m.allocated, slot_version=version, lock=True, release_lock_id=m.lock_id
        )
        held[:] = [prefill.lock_id]
        generated = [self.rng.randrange(1, 50_000) for _ in range(1 + self.rng.randrange(8))]
        session.insert(
            model,
            prompt + generated,
            m.allocated,
            slot_version=version,
            release_lock_id=prefill.lock_id,
        )
        held.clear()
        session.free(model, m.allocated)
        owned.clear()

    def _chunk(
        self,
        session: Any,
        model: str,
        key: list[int],
        held: list[int],
        owned: list[Any],
        foreign: int,
    ) -> None:
        m = session.match(model, key, allocate=True)
        owned.append(m.allocated)
        if foreign:
            self._refused_release(session, model, key, m.allocated, foreign, held)
        session.insert(model, key, m.allocated)
        session.free(model, m.allocated)
        owned.clear()

"""What the client's calls return: small frozen records, built from the wire replies.

Slot lists are ``array('q')`` (native int64). ``numpy.frombuffer`` and
``torch.frombuffer`` view them without a copy; the ``*_tensor`` helpers do that,
importing torch only when called. A record with ``skipped=True`` is a fail-open
stand-in: the service was unreachable or too slow and nothing was done.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from prefixcache.v1 import prefix_cache_pb2 as pb

from ._wire import as_tensor, concat, unpack_slots

CACHE_KINDS = {
    pb.CACHE_KIND_UNSPECIFIED: "unspecified",
    pb.CACHE_KIND_RADIX: "radix",
    pb.CACHE_KIND_SWA: "swa",
    pb.CACHE_KIND_MAMBA: "mamba",
    pb.CACHE_KIND_SLOT: "slot",
    pb.CACHE_KIND_CHUNK: "chunk",
}


def _slots() -> array[int]:
    return array("q")


_RETENTION_OUTCOMES = {
    pb.RETENTION_OUTCOME_ACCEPTED: "accepted",
    pb.RETENTION_OUTCOME_CLIPPED: "clipped",
    pb.RETENTION_OUTCOME_REJECTED: "rejected",
}


@dataclass(frozen=True, slots=True)
class Retained:
    """What a retention hint did (client/retention.py).

    Attributes:
        outcome: "accepted", "clipped" (seconds or priority lowered to the service's
            limits, or only the start of the prefix within the tenant's share) or
            "rejected" (retention off, a cache kind without it, or no share left).
        tokens: tokens of the prefix retained now.
        seconds, priority: as granted.
    """

    outcome: str
    tokens: int = 0
    seconds: float = 0.0
    priority: int = 0

    @classmethod
    def from_pb(cls, m: Any, field_name: str = "retention") -> Retained | None:
        """The ``retention`` result of a reply, None when it has none."""
        if not m.HasField(field_name):
            return None
        r = getattr(m, field_name)
        return cls(
            _RETENTION_OUTCOMES.get(r.outcome, "unspecified"),
            r.retained_tokens,
            r.seconds,
            r.priority,
        )


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


@dataclass(frozen=True, slots=True)
class MatchReply:
    """The longest cached prefix of a token sequence.

    Attributes:
        prefix_len: matched tokens (a multiple of the page size).
        slots: KV slot of each matched token; valid while the node is locked.
        node_id: handle of the deepest matched node (0 on a miss).
        lock_id: the lock taken with ``lock=True`` (0 on a miss or without lock).
        allocated: slots allocated for the unmatched tokens with ``allocate=True``.
        state_slot: Mamba models: the state slot after ``prefix_len`` tokens.
        mamba_branching_seqlen: Mamba models: see the proto.
        allocated_state_slot: Mamba models with ``allocate``: the request's state slot.
        slot_version: slot models: the version of the matched sequence slot.
        allocated_slot_version: slot models with ``allocate``: the new slot's version.
        skipped: fail-open: the service did not answer, this is an empty stand-in.
        server_epoch: the service's epoch; the handles above are valid only in it.
        page_ids, allocated_page_ids: with ``as_pages``, ``slots`` and ``allocated``
            as page ids instead (page ``p`` is slots ``[p * page_size, (p + 1) *
            page_size)``; the allocated slots are the first ``len(tokens) -
            prefix_len`` of their pages); ``slots`` and ``allocated`` are then empty.
        retained: what the call's (or its session's) retention hint did; None
            without one.
    """

    prefix_len: int = 0
    slots: array[int] = field(default_factory=_slots)
    node_id: int = 0
    lock_id: int = 0
    allocated: array[int] = field(default_factory=_slots)
    state_slot: int | None = None
    mamba_branching_seqlen: int | None = None
    allocated_state_slot: int | None = None
    slot_version: int | None = None
    allocated_slot_version: int | None = None
    skipped: bool = False
    server_epoch: int = 0
    page_ids: array[int] = field(default_factory=_slots)
    allocated_page_ids: array[int] = field(default_factory=_slots)
    retained: Retained | None = None

    @property
    def hit(self) -> bool:
        return self.prefix_len > 0

    def all_slots(self) -> array[int]:
        """Matched then allocated slots: one per requested token, ready for ``insert``."""
        return concat(self.slots, self.allocated)

    def slots_tensor(self, device: Any = None) -> Any:
        """``slots`` as an int64 torch tensor (imports torch)."""
        return as_tensor(self.slots, device)

    def allocated_tensor(self, device: Any = None) -> Any:
        """``allocated`` as an int64 torch tensor (imports torch)."""
        return as_tensor(self.allocated, device)

    @classmethod
    def from_pb(cls, m: pb.MatchResponse) -> MatchReply:
        return cls(
            m.prefix_len,
            unpack_slots(m.slot_indices),
            m.node_id,
            m.lock_id,
            unpack_slots(m.allocated_slots),
            _opt(m, "state_slot"),
            _opt(m, "mamba_branching_seqlen"),
            _opt(m, "allocated_state_slot"),
            _opt(m, "slot_version"),
            _opt(m, "allocated_slot_version"),
            server_epoch=m.server_epoch,
            page_ids=unpack_slots(m.page_ids),
            allocated_page_ids=unpack_slots(m.allocated_page_ids),
            retained=Retained.from_pb(m),
        )


@dataclass(frozen=True, slots=True)
class InsertReply:
    """What an insert did.

    Attributes:
        prefix_len: tokens that were cached before this call.
        cached_len: tokens cached now (the page-aligned length).
        node_id: handle of the node where the cached sequence ends (0 if none).
        lock_id: the lock taken with ``lock=True``.
        freed: the session's slots the tree did not need, already freed by the service.
        state_exist: Mamba models: the tree had the state, the request's was freed.
        skipped: fail-open: nothing was inserted (the session still holds its slots,
            unless the service restarted or the session was lost).
        server_epoch: the service's epoch; the handles above are valid only in it.
        retained: what the call's (or its session's) retention hint did; None
            without one.
    """

    prefix_len: int = 0
    cached_len: int = 0
    node_id: int = 0
    lock_id: int = 0
    freed: array[int] = field(default_factory=_slots)
    state_exist: bool = False
    skipped: bool = False
    server_epoch: int = 0
    retained: Retained | None = None

    @classmethod
    def from_pb(cls, m: pb.InsertResponse) -> InsertReply:
        return cls(
            m.prefix_len,
            m.cached_len,
            m.node_id,
            m.lock_id,
            unpack_slots(m.freed_slots),
            m.state_exist,
            server_epoch=m.server_epoch,
            retained=Retained.from_pb(m),
        )


@dataclass(frozen=True, slots=True)
class RetainReply:
    """What ``retain`` did: ``prefix_len`` tokens of the request were cached (the
    prefix the hint applied to) and ``retained`` (None only when ``skipped``)."""

    prefix_len: int = 0
    retained: Retained | None = None
    skipped: bool = False

    @classmethod
    def from_pb(cls, m: pb.RetainResponse) -> RetainReply:
        return cls(m.prefix_len, Retained.from_pb(m))


@dataclass(frozen=True, slots=True)
class LockReply:
    """A lock (``lock_id`` 0: nothing to lock, or ``skipped`` by fail-open)."""

    lock_id: int = 0
    skipped: bool = False
    server_epoch: int = 0


@dataclass(frozen=True, slots=True)
class UnlockReply:
    """An unlock; ``skipped`` when fail-open did not reach the service."""

    skipped: bool = False


@dataclass(frozen=True, slots=True)
class EvictReply:
    """Tokens (and state slots) eviction freed; may exceed the ask."""

    evicted_tokens: int = 0
    swa_evicted_tokens: int = 0
    mamba_evicted: int = 0

    @classmethod
    def from_pb(cls, m: pb.EvictResponse) -> EvictReply:
        return cls(m.evicted_tokens, m.swa_evicted_tokens, m.mamba_evicted)


@dataclass(frozen=True, slots=True)
class AllocReply:
    """Slots now held by the session (plus state slots and slot versions by kind).

    With ``as_pages``, ``page_ids`` instead of ``slots``: the session holds the first
    ``num_slots`` slots of these pages (page ``p``: slots ``[p * page_size, (p + 1) *
    page_size)``).
    """

    slots: array[int] = field(default_factory=_slots)
    state_slots: array[int] = field(default_factory=_slots)
    slot_versions: array[int] = field(default_factory=_slots)
    server_epoch: int = 0
    page_ids: array[int] = field(default_factory=_slots)

    def slots_tensor(self, device: Any = None) -> Any:
        """``slots`` as an int64 torch tensor (imports torch)."""
        return as_tensor(self.slots, device)

    @classmethod
    def from_pb(cls, m: pb.AllocResponse) -> AllocReply:
        return cls(
            unpack_slots(m.slot_indices),
            unpack_slots(m.state_slots),
            unpack_slots(m.slot_versions),
            m.server_epoch,
            unpack_slots(m.page_ids),
        )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One hosted model (``cache_kind`` is "radix", "swa", "mamba", "slot" or "chunk")."""

    name: str
    cache_kind: str
    page_size: int
    pool_size: int
    sliding_window_size: int = 0
    vocab_size: int = 0
    state_pool_size: int = 0
    # A tier below the tree (server.tier): a miss in the tree may still hit.
    tiered: bool = False

    @classmethod
    def from_pb(cls, m: pb.ModelInfo) -> ModelInfo:
        return cls(
            m.name,
            CACHE_KINDS.get(m.cache_kind, "unspecified"),
            m.page_size,
            m.pool_size,
            m.sliding_window_size,
            m.vocab_size,
            m.state_pool_size,
            m.tiered,
        )


@dataclass(frozen=True, slots=True)
class ModelList:
    """The hosted models, in configuration order, and the service's epoch."""

    models: tuple[ModelInfo, ...]
    server_epoch: int

    def __getitem__(self, name: str) -> ModelInfo:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)

    @classmethod
    def from_pb(cls, m: pb.ListModelsResponse) -> ModelList:
        return cls(tuple(ModelInfo.from_pb(x) for x in m.models), m.server_epoch)


@dataclass(frozen=True, slots=True)
class MambaLayout:
    """The Mamba state pool of a hybrid model (see ``MambaPoolLayout`` in the proto)."""

    layer_num: int
    conv_state_shape: tuple[int, ...]
    conv_dtype: str
    temporal_state_shape: tuple[int, ...]
    temporal_dtype: str
    working_slots: int
    state_slots: int
    num_rows: int


BUFFER_ROLES = {
    pb.BUFFER_ROLE_K: "k",
    pb.BUFFER_ROLE_V: "v",
    pb.BUFFER_ROLE_CONV: "conv",
    pb.BUFFER_ROLE_TEMPORAL: "temporal",
    pb.BUFFER_ROLE_SWA_K: "swa_k",
    pb.BUFFER_ROLE_SWA_V: "swa_v",
}


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """How to map one buffer of a pool (see ``BufferHandle`` in the proto).

    ``cuda`` holds the fields of ``UntypedStorage._share_cuda_()`` in order, or None
    for a shared-memory buffer at ``shm_path``.
    """

    role: str
    layer: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset_bytes: int = 0
    shm_path: str = ""
    cuda: tuple[Any, ...] | None = None

    @classmethod
    def from_pb(cls, m: pb.BufferHandle) -> BufferInfo:
        cuda = None
        if m.HasField("cuda"):
            c = m.cuda
            cuda = (
                c.device,
                c.handle,
                c.storage_size_bytes,
                c.storage_offset_bytes,
                c.ref_counter_handle,
                c.ref_counter_offset,
                c.event_handle,
                c.event_sync_required,
            )
        return cls(
            BUFFER_ROLES.get(m.role, str(m.role)),
            m.layer,
            tuple(m.shape),
            m.dtype,
            m.nbytes,
            m.offset_bytes,
            m.shm_path,
            cuda,
        )


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """The memory layout of a model's KV pool (see ``DescribePoolResponse``)."""

    model: str
    layer_num: int
    k_head_num: int
    k_head_dim: int
    v_head_num: int
    v_head_dim: int
    dtype: str
    device: str
    page_size: int
    pool_size: int
    num_rows: int
    swa_pool_size: int = 0
    mamba: MambaLayout | None = None
    max_seq_len: int = 0
    # How to map the pool from the same host (empty: it cannot be mapped).
    buffers: tuple[BufferInfo, ...] = ()
    # The service's epoch: the buffers are those of this start of the service.
    server_epoch: int = 0
    # MLA pool: one latent buffer per layer (the K buffers) and no V.
    mla: bool = False

    @classmethod
    def from_pb(cls, m: pb.DescribePoolResponse) -> PoolInfo:
        mamba = None
        if m.HasField("mamba"):
            x = m.mamba
            mamba = MambaLayout(
                x.layer_num,
                tuple(x.conv_state_shape),
                x.conv_dtype,
                tuple(x.temporal_state_shape),
                x.temporal_dtype,
                x.working_slots,
                x.state_slots,
                x.num_rows,
            )
        return cls(
            m.model,
            m.layer_num,
            m.k_head_num,
            m.k_head_dim,
            m.v_head_num,
            m.v_head_dim,
            m.dtype,
            m.device,
            m.page_size,
            m.pool_size,
            m.num_rows,
            m.swa_pool_size,
            mamba,
            m.max_seq_len,
            tuple(BufferInfo.from_pb(b) for b in m.buffers),
            m.server_epoch,
            m.mla,
        )


@dataclass(frozen=True, slots=True)
class ModelStats:
    """Counters of one model (see ``ModelStats`` in the proto)."""

    model: str
    evictable_tokens: int = 0
    protected_tokens: int = 0
    free_slots: int = 0
    match_tokens_total: int = 0
    hit_tokens_total: int = 0
    pool_size: int = 0
    session_slots: int = 0
    locks: int = 0
    evicted_tokens_total: int = 0
    swa_evictable_tokens: int = 0
    swa_protected_tokens: int = 0
    mamba_evictable_slots: int = 0
    mamba_protected_slots: int = 0
    free_state_slots: int = 0
    session_state_slots: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens_total / self.match_tokens_total if self.match_tokens_total else 0.0

    @classmethod
    def from_pb(cls, m: pb.ModelStats) -> ModelStats:
        return cls(
            m.model,
            m.evictable_tokens,
            m.protected_tokens,
            m.free_slots,
            m.match_tokens_total,
            m.hit_tokens_total,
            m.pool_size,
            m.session_slots,
            m.locks,
            m.evicted_tokens_total,
            m.swa_evictable_tokens,
            m.swa_protected_tokens,
            m.mamba_evictable_slots,
            m.mamba_protected_slots,
            m.free_state_slots,
            m.session_state_slots,
        )


@dataclass(frozen=True, slots=True)
class StatsReply:
    """Counters for the requested models; ``reply["m"]`` picks one by name."""

    models: tuple[ModelStats, ...]
    sessions: int
    server_epoch: int

    def __getitem__(self, name: str) -> ModelStats:
        for model in self.models:
            if model.model == name:
                return model
        raise KeyError(name)

    @classmethod
    def from_pb(cls, m: pb.StatsResponse) -> StatsReply:
        return cls(tuple(ModelStats.from_pb(x) for x in m.models), m.sessions, m.server_epoch)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A leased session as OpenSession granted it (``retained``: its default
    retention as granted, None without one)."""

    session_id: str
    ttl: float
    server_epoch: int
    retained: Retained | None = None

    @classmethod
    def from_pb(cls, m: pb.OpenSessionResponse) -> SessionInfo:
        return cls(m.session_id, m.ttl_seconds, m.server_epoch, Retained.from_pb(m))


@dataclass(frozen=True, slots=True)
class CloseReply:
    """What closing a session released."""

    locks_released: int = 0
    slots_freed: int = 0

    @classmethod
    def from_pb(cls, m: pb.CloseSessionResponse) -> CloseReply:
        return cls(m.locks_released, m.slots_freed)


@dataclass(frozen=True, slots=True)
class ResetReply:
    """What an admin Reset dropped."""

    dropped_tokens: int = 0
    dropped_locks: int = 0

    @classmethod
    def from_pb(cls, m: pb.ResetResponse) -> ResetReply:
        return cls(m.dropped_tokens, m.dropped_locks)

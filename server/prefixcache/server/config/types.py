"""The configuration's types: models, their pools, and the server's settings.

Loading and checking them is config/__init__.py's and config/checks.py's; the ``kv_events`` and
``tenants`` blocks of ServerConfig live in their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .disk import DiskConfig
from .kv_events import KvEventsConfig
from .retention import RetentionConfig
from .tenants import TenantConfig
from .tier import TierConfig

CACHE_KINDS = ("radix", "swa", "mamba", "slot", "chunk")
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Shape of a model's KV pool: ``size`` token slots of per-layer K and V rows."""

    size: int = 16384
    layers: int = 1
    k_heads: int = 2
    k_head_dim: int = 64
    v_heads: int | None = None
    v_head_dim: int | None = None
    dtype: str = "float16"
    device: str = "cpu"
    # SWA models only: slots of the sliding-window pool (defaults to ``size``).
    swa_size: int | None = None
    # MLA: one latent buffer per layer (k_heads x k_head_dim, usually 1 x 576) and no V.
    mla: bool = False


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """The Mamba state pool of a hybrid model (kind ``mamba``)."""

    # Slots that tree nodes and sessions hold (snapshots of the state after a prefix).
    state_slots: int = 256
    # Per-request working slots for attached workers; the service does not track them.
    working_slots: int = 0
    layers: int = 1
    conv_state_shape: tuple[int, ...] = (4, 3)
    temporal_state_shape: tuple[int, ...] = (1, 4, 4)
    dtype: str = "float16"
    temporal_dtype: str = "float32"
    # mamba_branching_seqlen is rounded down to a multiple of this.
    chunk_size: int = 1


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One hosted model: its cache kind, paging, eviction and pool."""

    name: str
    kind: str = "radix"
    page_size: int = 1
    sliding_window_size: int | None = None
    eviction_policy: str = "lru"
    # Token ids must be below this; 0 accepts any uint32.
    vocab_size: int = 0
    # The tokenizer's identity (a name and revision, or a hash of its files): with
    # vocab_size part of the tier's model fingerprint, so models that differ only
    # there never share pages (tier/keys.py).
    tokenizer: str = ""
    pool: PoolConfig = field(default_factory=PoolConfig)
    # Kind mamba only.
    mamba: MambaConfig | None = None
    # Kind slot only: positions per sequence slot (``pool.size`` is the slot count).
    max_seq_len: int = 0
    # ReadKV of any slot by any caller, with or without a session (kv_access.py). Off,
    # a caller reads only slots its session holds or has locked.
    open_reads: bool = False
    # With server.tier on: false keeps this model's pages out of the shared tier.
    tier: bool = True
    # With server.disk on: false keeps this model's pages off the disk tier.
    disk: bool = True


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the service listens, authenticates, logs and manages sessions."""

    listen: str = "unix:/tmp/prefixcache.sock"
    # Octal mode of the unix socket file; 0o600 keeps other users out.
    socket_mode: int = 0o600
    # Tell unix-socket clients apart by the kernel's word (uid and pid, access/unix_peers.py,
    # through a relay process); false: gRPC listens on the socket itself, a little less
    # per call, and such clients are told apart by the client_name they send.
    peer_credentials: bool = True
    # Loopback by default: /metrics tells the cache's size and traffic to whoever can
    # reach it. A pod sets its own IP (the Helm chart does); "0.0.0.0" is every address.
    metrics_host: str = "127.0.0.1"
    # 0 picks a free port (logged at start); -1 turns the metrics endpoint off.
    metrics_port: int = 9470
    # A bearer token every scrape must carry (401 without it); None: open.
    metrics_token: str | None = None
    metrics_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # TCP without TLS sends tokens in clear text, so it must be asked for by name.
    insecure: bool = False
    token: str | None = None
    token_file: str | None = None
    admin_token: str | None = None
    admin_token_file: str | None = None
    session_ttl: float = 30.0
    session_ttl_min: float = 1.0
    session_ttl_max: float = 600.0
    grace_period: float = 10.0
    max_message_bytes: int = 64 * 1024 * 1024
    # CPU pools live in shared-memory files here, so workers on this host can map them
    # (DescribePool); "" or "off" keeps them private (ReadKV / WriteKV still work).
    shm_dir: str = "/dev/shm"
    log_format: str = "text"
    log_level: str = "info"
    # Invariant mode (staging): check the caches' integrity after every mutating call;
    # a failure answers INTERNAL and is logged.
    check_integrity: bool = False
    # Warm restart (warm_restart.py): the CPU pools' files under shm_dir outlive the
    # process, and a sealed snapshot of the trees is written beside them every
    # warm_checkpoint_interval seconds while serving (0: only at a clean stop) and at a
    # clean stop (SIGTERM); the next start with the same models takes both over and
    # serves the pages whose seals verify, so cached prompts hit again, after a crash
    # too. Radix and chunk models only (others start cold, logged); needs shm_dir. A
    # checkpoint larger than warm_checkpoint_max_bytes (0: no cap but shm_dir's free
    # space) is skipped. Another service's sweep of shm_dir leaves the pool files of a
    # stopped or crashed warm-restart service for warm_keep seconds (at most a day).
    warm_restart: bool = False
    warm_checkpoint_interval: float = 30.0
    warm_checkpoint_max_bytes: int = 0
    warm_keep: float = 3600.0
    # Limits: what one client may take of a service that others share. Each is generous
    # by default; a refusal names its setting and counts in prefixcache_refusals_total.
    # Sizes of request fields, in UTF-8 bytes (INVALID_ARGUMENT beyond them).
    max_extra_key_bytes: int = 4096
    max_client_name_bytes: int = 256
    max_session_id_bytes: int = 128
    # Token ids, or slot indices, in one request (RESOURCE_EXHAUSTED beyond it); 0 takes
    # each model's pool size (for kind slot, the larger of the slot count and max_seq_len).
    max_request_tokens: int = 0
    # Open sessions, leased and streams together (RESOURCE_EXHAUSTED beyond it).
    max_sessions: int = 10000
    # Open sessions of one client, checked before max_sessions, so that one client
    # cannot lock the others out (RESOURCE_EXHAUSTED beyond it; 0: off). A client is what
    # it cannot choose: a tenant's token, a unix peer's uid and pid, a TCP peer's address
    # (on loopback its socket's uid) (tenants.client_identity).
    max_sessions_per_client: int = 1000
    # Per-session quotas (quotas.py), per model, checked before anything changes
    # (RESOURCE_EXHAUSTED beyond them). Slots one session holds (allocated, not yet
    # inserted or freed; 0: the model's pool size, so no cap but the pool, as the one
    # worker of a sidecar needs it all). A mamba model's state slots one session holds
    # (0: its state pool's size). Tokens one session's locks protect, each lock
    # counting its whole prefix, so a prefix under ten locks counts ten times (0, the
    # default: off; "auto": 90% of the pool's tokens for radix, swa and mamba models,
    # so one session never protects the whole cache). ReadKV and WriteKV streams of one
    # session in flight at once.
    max_session_slots: int = 0
    max_session_state_slots: int = 0
    max_session_locked_tokens: int | None = 0
    max_session_streams: int = 64
    # Subscribe streams (subscriptions.py) open at once, in all, per session (a request
    # names its session_id to count against it) and per client (its session's client,
    # else the caller as tenants.client_identity tells it, so all of one process's
    # streams without a session together, such as a worker's shadow index;
    # the default leaves half of max_subscribe_streams to the others; 0: off),
    # RESOURCE_EXHAUSTED beyond any; a subscriber further behind than
    # max_subscriber_pending_bytes (32 bytes per page hash of its snapshot not yet sent
    # and of the changes after it; 0: 64 MiB, or twice the largest model's pool in
    # pages if more) is dropped (RESOURCE_EXHAUSTED).
    max_subscribe_streams: int = 64
    max_session_subscribes: int = 8
    max_subscribes_per_client: int = 32
    max_subscriber_pending_bytes: int = 0
    # One Step call: its items (finishes, unlocks, frees, decodes and admits together)
    # and the bytes of token ids and slot indices they carry. A Step over either is
    # refused whole (RESOURCE_EXHAUSTED), before it does anything; max_step_bytes 0
    # leaves only max_message_bytes.
    max_step_items: int = 8192
    max_step_bytes: int = 0
    # A request's bytes, refused before it is parsed when over (request_caps.py); 0
    # derives a cap per request type from the limits above (RESOURCE_EXHAUSTED beyond).
    max_request_bytes: int = 0
    # A Session stream that sends nothing for this long ends, and what it holds is freed.
    stream_ttl: float = 300.0
    # gRPC keepalive: ping a connection after keepalive_time seconds of silence and close
    # it when the ping is not answered within keepalive_timeout (a frozen or vanished
    # client). Clients may send their own pings every keepalive_min_client_interval.
    keepalive_time: float = 30.0
    keepalive_timeout: float = 10.0
    keepalive_min_client_interval: float = 10.0
    # Log lines waiting for a slow stderr; past this many, records are dropped (and
    # counted in prefixcache_log_records_dropped_total) rather than block the service.
    log_queue_lines: int = 10000
    # KV transfer (kv_access.py). ReadKV chunks are at least min_chunk_bytes (a smaller
    # max_chunk_bytes is raised to it, never refused); one ReadKV answers at most
    # max_read_bytes, duplicates included (0: the model's whole pool, once). WriteKV
    # writes rows as they arrive and holds only a partial row per buffer; those held
    # bytes are capped per session and in total (RESOURCE_EXHAUSTED beyond either).
    min_chunk_bytes: int = 64 * 1024
    max_read_bytes: int = 0
    max_inflight_write_bytes: int = 256 * 1024 * 1024
    max_inflight_write_bytes_total: int = 1024 * 1024 * 1024
    # Evict (evict_policy.py): tokens one client may evict per evict_interval without
    # the admin token (a token bucket; RESOURCE_EXHAUSTED while it is empty,
    # PERMISSION_DENIED for one call over the whole of it); 0 lets every caller evict
    # any amount.
    max_evict_tokens: int = 0
    # The seconds in which a client's Evict budget refills from empty to
    # max_evict_tokens: a client may evict max_evict_tokens per evict_interval.
    evict_interval: float = 1.0
    # Mode of the shared-memory pool files; None (the default) takes the socket's owner
    # and group bits only, so a looser socket_mode never makes the pool world-writable.
    shm_mode: int | None = None
    # Tokens bound to extra_key namespaces (tenants.py) (config/tenants.py).
    tenants: tuple[TenantConfig, ...] = ()
    # Clients' retention hints: on, and their bounds (config/retention.py).
    retention: RetentionConfig = field(default_factory=lambda: RetentionConfig())
    # With a capacity, each radix, swa and mamba model keeps a change log of its cached
    # pages, which Subscribe streams to workers' shadow indexes (and KV events publish),
    # and a page-hash index for the page RPCs (SGLang's HiCache backend): this many
    # changes are kept for subscribers that resume or fall behind (older ones get a
    # snapshot). Off (0) by default, as KV events are in vLLM and SGLang: the page
    # hashing and indexing at insert cost about 2 us a page, several times the rest of
    # an Insert. kv_events turns the logs on by itself. 65536 is a good value.
    change_log_capacity: int = 0
    # KV events out (vLLM/SGLang ZMQ wire format) (config/kv_events.py).
    kv_events: KvEventsConfig = field(default_factory=lambda: KvEventsConfig())
    # The shared cross-node KV tier (config/tier.py, server/tier/); None: off.
    tier: TierConfig | None = None
    # The local disk tier below each pool (config/disk.py, server/tier/disk/); None: off.
    disk: DiskConfig | None = None


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the service needs to start."""

    server: ServerConfig
    models: tuple[ModelConfig, ...]

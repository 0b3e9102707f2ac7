"""KV events out: each model's change log, published over ZMQ as vLLM and SGLang do.

Cache-aware routers (llm-d's KV-cache indexer, Dynamo's KV router, Mooncake Conductor,
SGLang's router) subscribe to the ZMQ events engines publish; publishing the same
events lets them route a fleet of sidecars with no code on their side. The wire format
is in events/wire.py; this module runs the sockets.

Per model one publisher (``server.kv_events``, off by default):

* Frames ``[topic, seq, payload]``: ``topic`` UTF-8 (default ``kv@<host>:<port>@<model>``,
  host from ``$POD_IP`` or the host name's address, port the event port); ``seq`` 8
  bytes big-endian from 0 at every start, one per batch; ``payload`` the msgpack batch.
* The first batch is ``AllBlocksCleared`` followed by the tree's pages (none at start),
  so a subscriber from the start sees the whole history. Reset sends AllBlocksCleared.
* Several models: model ``i`` (its position in the config) publishes on the endpoint's
  TCP port + ``i`` (ipc/inproc endpoints get a ``_<i>`` suffix), and so does its replay
  socket, as vLLM offsets ports per data-parallel rank.
* Batching: everything the cache changed during one turn of the event loop (one RPC,
  or several handled together) goes out as one batch, sent on the next turn.
* Never blocking, and one subscriber never costs another: the socket is a plain XPUB
  (no ``XPUB_NODROP``), so a subscriber whose queue is at the high-water mark (``hwm``
  batches) loses that batch alone; every other subscriber still gets it. The slow one
  sees a seq gap and replays it (every batch is kept for replay). A stuck subscriber
  pins at most ``hwm`` batches (plus the kernel's socket buffers), never more.
* Replay: a ROUTER socket on ``replay_endpoint``. A request ``[identity, b"", start
  (8 bytes BE)]`` gets ``[identity, b"", seq, payload]`` for every buffered batch from
  ``start``, then ``[identity, b"", -1 (8 bytes, signed), b""]``. If ``start`` is older
  than the buffer (the last ``buffer_steps`` batches), the answer starts with a snapshot:
  one batch stamped with the seq ``S`` it reflects (``AllBlocksCleared`` and every cached
  page), then the batches after ``S``, so a subscriber that fell too far behind
  resynchronises instead of missing changes. Over a cap the answer is ``[identity, b"",
  -1, b"busy"]``. Shared snapshots, the caps and requesters that do not read:
  events/replay.py.

Runs on the service's event loop, like the engines it reads (``loop.add_reader`` on the
sockets' ZMQ file descriptors, which are edge-triggered: every handler drains until
``EVENTS`` shows nothing more).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from prefixcache.cache.index.change_log import Change, ChangeLog

from ..config import ConfigError, KvEventsConfig
from ..config.kv_events import MIN_KEY_BYTES, check_kv_events_tenants, read_key
from ..config.tier import read_tier_secret
from ..memory.page_seal import derive_key
from .replay import END_SEQ, ReplayServer
from .wire import EventEncoder

log = logging.getLogger("prefixcache.server")

__all__ = ["END_SEQ", "KvEventPublisher", "KvEventPublishers", "start_kv_events"]


def endpoint_for(endpoint: str, index: int) -> str:
    """The endpoint of the ``index``-th model: TCP port + index, or an ipc/inproc suffix."""
    if index == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_{index}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:  # "*" or 0: every model gets its own free port
        return endpoint
    return f"{base}:{int(port) + index}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def medium_of(device: str) -> str:
    return "GPU" if device.startswith("cuda") else "CPU"


def pod_host() -> str:
    """This pod's address for topics: $POD_IP (the Downward API), else the host name's."""
    host = os.environ.get("POD_IP")
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class KvEventPublisher:
    """One model's PUB (and optional ROUTER replay) socket, fed by its change log.

    Counters (read by the metrics collector): ``batches_published``,
    ``events_published`` and the replay server's (``replays_served``,
    ``replays_refused``, ``replays_dropped``, ``replay_requests_invalid``,
    ``replay_snapshots``).
    """

    def __init__(
        self,
        model: str,
        change_log: ChangeLog,
        cfg: KvEventsConfig,
        *,
        index: int,
        medium: str,
        context: zmq.Context,
        hide_key: bytes | None = None,
    ) -> None:
        self.model = model
        self.endpoint = endpoint_for(cfg.endpoint, index)
        self.bound = binds(self.endpoint)  # vLLM's rule (see start)
        self.replay_endpoint = (
            endpoint_for(cfg.replay_endpoint, index) if cfg.replay_endpoint else None
        )
        self.topic = ""
        self.batches_published = 0
        self.events_published = 0
        self._cfg = cfg
        self._log = change_log
        self._ctx = context
        self._encoder = EventEncoder(cfg.hash_format, cfg.encoding, medium, hide_key=hide_key)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._pending: list[Change] = []
        self._flush_scheduled = False
        self._pub: zmq.Socket[bytes] | None = None
        self.replay: ReplayServer | None = None  # with a replay_endpoint, once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unwatch: Any = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def _replay_count(self, name: str) -> int:
        return 0 if self.replay is None else getattr(self.replay, name)

    @property
    def replays_served(self) -> int:
        return self._replay_count("served")

    @property
    def replays_refused(self) -> int:
        return self._replay_count("refused")

    @property
    def replays_dropped(self) -> int:
        return self._replay_count("dropped")

    @property
    def replay_requests_invalid(self) -> int:
        return self._replay_count("invalid")

    @property
    def replay_snapshots(self) -> int:
        return self._replay_count("snapshots")

    def start(self, loop: asyncio.AbstractEventLoop, topic_host: str) -> None:
        """Bind (or connect) the sockets and publish the first batch.

        Raises:
            ConfigError: an endpoint cannot be bound or connected.
        """
        self._loop = loop
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        # Per subscriber: past hwm ZMQ drops that subscriber's copy only. XPUB_NODROP
        # would instead fail the send for everyone once one peer is full.
        pub.setsockopt(zmq.SNDHWM, self._cfg.hwm)
        self.endpoint = _open(pub, self.endpoint, "endpoint")
        self._pub = pub
        if self.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            ReplayServer.configure(replay)
            self.replay_endpoint = _open(replay, self.replay_endpoint, "replay_endpoint", bind=True)
            self.replay = ReplayServer(
                self.model,
                replay,
                self._cfg,
                buffer=self._buffer,
                newest=lambda: self._seq - 1,
                flush=self.flush,
                log=self._log,
                encoder=self._encoder,
                loop=loop,
            )
            self.replay.start()
        loop.add_reader(pub.getsockopt(zmq.FD), self._drain_subscriptions)
        port = self.endpoint.rpartition(":")[2] if self.endpoint.startswith("tcp://") else "0"
        template = self._cfg.topic or "kv@{host}:{port}@{model}"
        self.topic = (
            template.replace("{host}", topic_host)
            .replace("{port}", port)
            .replace("{model}", self.model)
        )
        self._topic = self.topic.encode("utf-8")
        self._resync()
        self._unwatch = self._log.watch(self._on_change)
        # vLLM's rule, said out loud: a concrete address is connected to (a relay or a
        # router's bound SUB must be listening there), not bound.
        log.info(
            "publishing KV events: %s %s",
            "bound to"
            if self.bound
            else "connecting to (a concrete address; bind with tcp://*:PORT)",
            self.endpoint,
            extra={
                "model": self.model,
                "endpoint": self.endpoint,
                "topic": self.topic,
                "mode": "bind" if self.bound else "connect",
                "replay_endpoint": self.replay_endpoint,
            },
        )

    def close(self) -> None:
        """Publish what is pending, stop listening to the log and close the sockets."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._pub is not None:
            self.flush()
        if self.replay is not None:
            self.replay.close()
        if self._pub is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._pub.getsockopt(zmq.FD))
            self._pub.close(linger=0)
        self._pub = None

    # ----------------------------------------------------------- publishing

    def _on_change(self, change: Change) -> None:
        # Inside a cache operation: only note it; the batch goes out on the next turn.
        self._pending.append(change)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Publish the pending changes as one batch (nothing if there are none)."""
        self._flush_scheduled = False
        if not self._pending or self._pub is None:
            return
        changes, self._pending = self._pending, []
        try:
            events = [self._encoder.event(change) for change in changes]
        except KeyError:
            # A page's parent was never published: we were fed out of order. Never
            # leave subscribers with a hole; start them over from the tree.
            log.exception(
                "KV events out of order; resending the whole page set", extra={"model": self.model}
            )
            self._resync()
            return
        self._send(events)

    def _resync(self) -> None:
        """Publish AllBlocksCleared and the tree's pages, and continue from there."""
        self._pending.clear()
        self._send(self._encoder.snapshot_events(self._log.snapshot(), restart=True))

    def _send(self, events: list[Any]) -> None:
        if self._pub is None:
            return  # closed (a resync after close): there is nobody to send to
        payload = self._encoder.batch(events)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))  # kept for replay: a slow peer's copy drops
        if self.replay is not None:
            self.replay.published(seq, payload)
        # A plain XPUB never fails a send for a full peer (it drops that peer's copy);
        # NOBLOCK is belt and braces so the loop can never wait here.
        try:
            self._pub.send_multipart(
                (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK, copy=False
            )
        except zmq.Again:  # not raised by a plain XPUB; never let it reach the loop
            return
        self.batches_published += 1
        self.events_published += len(events)
        self._drain_subscriptions()

    def _drain_subscriptions(self) -> None:
        # XPUB hands (un)subscription messages up; nobody needs them, but unread they
        # would pile up (and the edge-triggered FD would stay silent).
        pub = self._pub
        while pub is not None and pub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break


def _open(sock: zmq.Socket[bytes], endpoint: str, name: str, bind: bool | None = None) -> str:
    """Bind or connect ``sock``; returns the endpoint it ended up on (real port)."""
    try:
        if binds(endpoint) if bind is None else bind:
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ConfigError(f"server.kv_events.{name}: cannot use {endpoint}: {exc}") from exc


class KvEventPublishers:
    """The publishers of every model that has a change log (radix, swa and mamba)."""

    def __init__(
        self, cfg: KvEventsConfig, engines: Mapping[str, Any], tier_secret_file: str | None = None
    ) -> None:
        # Before the context: a bad key file fails with nothing open.
        key = hash_key(cfg, tier_secret_file)
        self.context = zmq.Context()
        self.publishers: dict[str, KvEventPublisher] = {}
        for index, (name, engine) in enumerate(engines.items()):
            change_log = getattr(engine, "change_log", None)
            if change_log is None:  # slot and chunk kinds cache no pages
                continue
            self.publishers[name] = KvEventPublisher(
                name,
                change_log,
                cfg,
                index=index,
                medium=medium_of(engine.config.pool.device),
                context=self.context,
                hide_key=key,
            )
        self._check_distinct()

    def _check_distinct(self) -> None:
        # Model i takes port + i for events and replay_port + i for replay: two ranges
        # that overlap once there are more models than the ports are apart.
        taken: dict[str, str] = {}
        for name, publisher in self.publishers.items():
            for kind, endpoint in (
                ("endpoint", publisher.endpoint),
                ("replay_endpoint", publisher.replay_endpoint),
            ):
                if endpoint is None or endpoint.endswith((":*", ":0")):  # any free port
                    continue
                if endpoint in taken:
                    self.context.destroy(linger=0)
                    raise ConfigError(
                        f"server.kv_events.{kind}: model {name!r} would use {endpoint}, "
                        f"which is {taken[endpoint]}; model i uses port + i, so keep "
                        "endpoint and replay_endpoint more ports apart than there are models"
                    )
                taken[endpoint] = f"model {name!r}'s {kind}"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        host = pod_host()
        try:
            for publisher in self.publishers.values():
                publisher.start(loop, host)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()
        self.context.destroy(linger=0)


def hash_key(cfg: KvEventsConfig, tier_secret_file: str | None = None) -> bytes | None:
    """The key of hashed events (``kv_events.tenants: hashed``): ``hash_key_file``'s
    bytes; else one derived from the tier's cluster secret (``tier.secret_file``), so
    every sidecar of the cluster publishes the same hashes; else a random one for this
    start (logged: routers cannot compute hashes from tokens then); None for the other
    policies.

    Raises:
        ConfigError: a key or secret file is unreadable or too short.
    """
    if cfg.tenants != "hashed":
        return None
    if cfg.hash_key_file is None and tier_secret_file is not None:
        return derive_key(read_tier_secret(tier_secret_file), "kv-events", None)
    if cfg.hash_key_file is None:
        log.warning(
            "kv_events: block hashes and namespace names are keyed with a random "
            "key of this start (kv_events.hash_key_file is not set): routers "
            "cannot compute them from a request's tokens, and they change at "
            "every start"
        )
        return secrets.token_bytes(MIN_KEY_BYTES)
    return read_key(cfg.hash_key_file, "server.kv_events.hash_key_file")


def start_kv_events(
    cfg: KvEventsConfig,
    engines: Mapping[str, Any],
    tenants: Sequence[Any] = (),
    tier_secret_file: str | None = None,
) -> KvEventPublishers | None:
    """The running publishers, or None when ``server.kv_events`` leaves them off.

    Raises:
        ConfigError: an endpoint is unusable, or ``tenants`` are configured and
            ``kv_events.tenants`` is ``refuse`` (checked here too, for configs built
            without load_config: nothing is published by accident).
    """
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return None
    check_kv_events_tenants(cfg, tenants, "server.kv_events")
    publishers = KvEventPublishers(cfg, engines, tier_secret_file)
    publishers.start(asyncio.get_running_loop())
    return publishers

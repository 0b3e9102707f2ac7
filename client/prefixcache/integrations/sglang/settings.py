"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config`` JSON and
the worker's place in the parallel layout (``HiCacheStorageConfig``).

Keys of the JSON this backend reads (SGLang's own ``backend_name``, ``module_path``,
``class_name`` and ``interface_v1`` are ignored here):

* ``target``: the sidecar's address (``unix:/path`` or ``host:port``; default
  ``unix:/tmp/prefixcache.sock``).
* ``model``: the sidecar model that holds this worker's pages (default: SGLang's
  served model name). Format fields ``{tp_rank}``, ``{tp_size}``, ``{pp_rank}``,
  ``{pp_size}``, ``{cp_rank}``, ``{cp_size}``, ``{dp_rank}`` pick a model per rank
  when ranks need pools of different shapes (pipeline stages with different layers).
* ``extra_key``: the namespace of the pages (default: unset, the default namespace,
  where workers that insert tokens cache theirs). ``token_width``: its token width (1).
* ``transfer``: ``auto`` (default: map the pool when the sidecar's host shares it,
  else stream), ``attach`` or ``rpc``.
* ``timeout``: seconds per call (default 5). ``retry_after``: seconds the backend
  answers misses without calling after the sidecar failed a call (default 1).
* ``token``: the sidecar's bearer token, or ``token_env``: a variable holding it.
* ``session_ttl``: the lease of the backend's session (default 30 s).

Isolation: every page name is a chained hash of tokens, so two models or two token
namespaces never share a page by accident; ranks that hold different parts of a page
(tensor-parallel heads, pipeline stages, context-parallel shards) get namespaces of
their own (``rank_namespace``). MLA ranks hold the same latent KV and share pages.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TARGET = "unix:/tmp/prefixcache.sock"
TRANSFERS = ("auto", "attach", "rpc")
# Where a rank suffix starts in a namespace (no client namespace is expected to hold it).
RANK_SEPARATOR = "#sglang:"


@dataclass(frozen=True, slots=True)
class Ranks:
    """Where this worker sits in SGLang's parallel layout."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    is_mla: bool = False

    @classmethod
    def of(cls, storage_config: Any) -> Ranks:
        """From SGLang's ``HiCacheStorageConfig`` (or anything with its fields)."""

        def get(name: str, default: object) -> Any:
            return getattr(storage_config, name, default)

        return cls(
            tp_rank=int(get("tp_rank", 0)),
            tp_size=int(get("tp_size", 1)),
            pp_rank=int(get("pp_rank", 0)),
            pp_size=int(get("pp_size", 1)),
            cp_rank=int(get("attn_cp_rank", 0)),
            cp_size=int(get("attn_cp_size", 1)),
            dp_rank=int(get("dp_rank", 0)),
            is_mla=bool(get("is_mla_model", False)),
        )

    def suffix(self) -> str:
        """The ranks that hold different bytes for the same page ("" when none do)."""
        parts = []
        if self.tp_size > 1 and not self.is_mla:
            parts.append(f"tp{self.tp_rank}of{self.tp_size}")
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        if self.cp_size > 1:
            parts.append(f"cp{self.cp_rank}of{self.cp_size}")
        return ".".join(parts)


def rank_namespace(extra_key: str | None, ranks: Ranks) -> str | None:
    """The namespace this rank's pages live in: ``extra_key`` itself when every rank
    holds whole pages (TP 1, or MLA), else ``extra_key`` with the ranks appended."""
    suffix = ranks.suffix()
    if not suffix:
        return extra_key
    return f"{extra_key or ''}{RANK_SEPARATOR}{suffix}"


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the backend needs to know before it connects."""

    target: str = DEFAULT_TARGET
    model: str = ""
    extra_key: str | None = None
    token_width: int = 1
    transfer: str = "auto"
    timeout: float = 5.0
    retry_after: float = 1.0
    token: str | None = None
    session_ttl: float = 30.0
    ranks: Ranks = Ranks()

    @property
    def namespace(self) -> str | None:
        """The namespace this rank's pages are looked up and stored in."""
        return rank_namespace(self.extra_key, self.ranks)

    @classmethod
    def parse(
        cls, extra_config: Mapping[str, Any] | None, ranks: Ranks, model_name: str | None = None
    ) -> Settings:
        """Settings from the extra-config JSON; a bad value raises ValueError."""
        cfg = dict(extra_config or {})
        model = str(cfg.get("model") or model_name or "")
        if not model:
            raise ValueError(
                'prefixcache HiCache backend: set "model" in '
                "--hicache-storage-backend-extra-config (the sidecar's model)"
            )
        try:
            model = model.format(
                tp_rank=ranks.tp_rank,
                tp_size=ranks.tp_size,
                pp_rank=ranks.pp_rank,
                pp_size=ranks.pp_size,
                cp_rank=ranks.cp_rank,
                cp_size=ranks.cp_size,
                dp_rank=ranks.dp_rank,
            )
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f'prefixcache HiCache backend: bad "model" template {model!r}: {exc}'
            ) from None
        transfer = str(cfg.get("transfer", "auto"))
        if transfer not in TRANSFERS:
            raise ValueError(
                f'prefixcache HiCache backend: "transfer" must be one of '
                f"{', '.join(TRANSFERS)}, got {transfer!r}"
            )
        token = cfg.get("token")
        if token is None and cfg.get("token_env"):
            token = os.environ.get(str(cfg["token_env"]))
        extra_key = cfg.get("extra_key")
        return cls(
            target=str(cfg.get("target") or DEFAULT_TARGET),
            model=model,
            extra_key=None if extra_key is None else str(extra_key),
            token_width=_positive(cfg, "token_width", 1, int),
            transfer=transfer,
            timeout=_positive(cfg, "timeout", 5.0, float),
            retry_after=_positive(cfg, "retry_after", 1.0, float, zero=True),
            token=None if token is None else str(token),
            session_ttl=_positive(cfg, "session_ttl", 30.0, float),
            ranks=ranks,
        )


def _positive(
    cfg: Mapping[str, Any], key: str, default: Any, kind: type, zero: bool = False
) -> Any:
    value = cfg.get(key, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f'prefixcache HiCache backend: "{key}" must be a number, got {value!r}'
        ) from None
    if number < 0 or (number == 0 and not zero):
        raise ValueError(
            f'prefixcache HiCache backend: "{key}" must be '
            f"{'>= 0' if zero else '> 0'}, got {value!r}"
        )
    return number

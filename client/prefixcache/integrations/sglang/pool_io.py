"""Pages between the sidecar's pool rows and SGLang's host pages: mapped or streamed.

A transfer names the pool slots of ``n`` pages (``page_size`` each, in page order) and,
per page, the host page they go to or come from: a ``HostLayout`` and the host token
position where the page starts (a flat page is a one-page ``HostLayout`` at 0).

``AttachedIO`` copies through the pool mapped into this process (shared memory for a
CPU pool, CUDA IPC for a GPU pool), with no RPC. Pages of the host pool move with one
indexing copy per layer and part over all of them (``HostLayout.pages_view``: a page
is one element), straight from or into the pool's rows when the slots are one run (the
allocator hands out whole pages, so they usually are); flat pages, one slice copy per
page and layer.
``RemoteIO`` streams the rows with ReadKV and WriteKV, for a sidecar whose pool this
process cannot map. Rows cross bit for bit (``bitcast``), so fp8 KV that one side keeps
as uint8 arrives unchanged; an MLA host pool has no V, so V is neither read nor
written (beyond zeros, through WriteKV, for a pool that keeps one).

The rows are the sidecar's to guard: a load reads slots the session has locked
(GetPages), a store writes slots it holds (Alloc).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prefixcache.client.results import PoolInfo
from prefixcache.client.transfer.kv import wide_pair

from .host_layout import HostLayout, K, V, bitcast

# One page of a transfer: the host pool (or flat page) and its first token position.
HostPage = tuple[HostLayout, int]


class PoolIO(Protocol):
    """Moves pages between the sidecar's pool and host pages."""

    info: PoolInfo

    def load(self, slots: Any, pages: list[HostPage], layers: list[int], session: Any) -> None: ...

    def store(self, slots: Any, pages: list[HostPage], layers: list[int], session: Any) -> None: ...

    def close(self) -> None: ...


def _parts(pages: list[HostPage]) -> tuple[str, ...]:
    return (K,) if pages[0][0].is_mla else (K, V)


class AttachedIO:
    """Through the pool mapped into this process (``PrefixCacheClient.attach_pool``)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.info: PoolInfo = pool.info

    def load(self, slots: Any, pages: list[HostPage], layers: list[int], session: Any) -> None:
        batch = _batch(pages, self.pool.k_buffer[0])
        if batch is not None:
            self._load_batch(slots, batch, layers, pages)
            return
        runs = _Runs(slots, self.info.page_size, self.pool.k_buffer[0].device)
        for buf, i, dst in self._flat_pages(pages, layers):
            dst.copy_(bitcast(runs.rows(buf, i), dst.dtype))

    def store(self, slots: Any, pages: list[HostPage], layers: list[int], session: Any) -> None:
        batch = _batch(pages, self.pool.k_buffer[0])
        if batch is not None:
            self._store_batch(slots, batch, layers, pages)
            return
        runs = _Runs(slots, self.info.page_size, self.pool.k_buffer[0].device)
        for buf, i, src in self._flat_pages(pages, layers):
            runs.put(buf, i, src)

    def _flat_pages(
        self, pages: list[HostPage], layers: list[int]
    ) -> Iterator[tuple[Any, int, Any]]:
        """(pool buffer, page number, host view) for every layer, part and page: the
        page-at-a-time path of pages that are not one host pool's."""
        for layer in layers:
            for part in _parts(pages):
                buf = self._buffers(part)[layer]
                for i, (host, start) in enumerate(pages):
                    yield buf, i, host.page_view(part, layer, start)

    # Pages of one host pool: one indexing copy per layer and part, over all the pages
    # (a page-sized element each), straight from or into the pool's rows when the slots
    # are one run.

    def _load_batch(
        self, slots: Any, batch: tuple[HostLayout, Any], layers: list[int], pages: list[HostPage]
    ) -> None:
        host, page_ids = batch
        first = _run(slots, self.pool.k_buffer[0].shape[0])
        index = None if first is not None else slots.to(self.pool.k_buffer[0].device)
        count = len(pages)
        for layer in layers:
            for part in _parts(pages):
                buf = self._buffers(part)[layer]
                dst = host.pages_view(part, layer)
                rows = (
                    buf[first : first + len(slots)] if index is None else buf.index_select(0, index)
                )
                rows = rows.view(count, -1, *rows.shape[1:]).to(dst.device)
                d, r = wide_pair(dst, rows)
                d.index_copy_(0, page_ids, r)

    def _store_batch(
        self, slots: Any, batch: tuple[HostLayout, Any], layers: list[int], pages: list[HostPage]
    ) -> None:
        import torch

        host, page_ids = batch
        first = _run(slots, self.pool.k_buffer[0].shape[0])
        device = self.pool.k_buffer[0].device
        count = len(pages)
        for layer in layers:
            for part in _parts(pages):
                buf = self._buffers(part)[layer]
                src = host.pages_view(part, layer)
                if first is not None and src.device == device:
                    out = buf[first : first + len(slots)]
                    s, o = wide_pair(src, out.view(count, -1, *out.shape[1:]))
                    torch.index_select(s, 0, page_ids, out=o)
                    continue
                rows = src.index_select(0, page_ids).to(device)
                rows = bitcast(rows.reshape(len(slots), *rows.shape[2:]), buf.dtype)
                buf.index_copy_(0, slots.to(device), rows)

    def _buffers(self, part: str) -> list[Any]:
        return self.pool.k_buffer if part == K else self.pool.v_buffer

    def close(self) -> None:
        self.pool.close()


def _batch(pages: list[HostPage], pool_rows: Any) -> tuple[HostLayout, Any] | None:
    """The host pool of ``pages`` and their page numbers, when they are all pages of
    one host pool (not flat pages) with the pool's element size; else None."""
    import torch

    host = pages[0][0] if pages else None
    if (
        host is None
        or any(h is not host for h, _ in pages)
        or host.dtype.itemsize != pool_rows.element_size()
        or host.pages_view(K, 0) is None
    ):
        return None
    size = host.page_size
    return host, torch.tensor(
        [start // size for _, start in pages], dtype=torch.int64, device=host.k.device
    )


def _run(slots: Any, rows: int) -> int | None:
    """The first slot when ``slots`` (int64) are consecutive and inside ``rows``."""
    if not len(slots):
        return None
    first = int(slots[0])
    if first < 0 or first + len(slots) > rows or int(slots[-1]) - first != len(slots) - 1:
        return None
    return first if bool((slots[1:] - slots[:-1] == 1).all()) else None


class _Runs:
    """Each page's slots: a block of consecutive rows (the common case: the allocator
    hands out whole pages) or, failing that, an index."""

    def __init__(self, slots: Any, page_size: int, device: Any) -> None:
        self.size = page_size
        per_page = slots.view(-1, page_size)
        steps = per_page[:, 1:] - per_page[:, :-1]
        self.first = per_page[:, 0].tolist()
        self.block = (steps == 1).all(dim=1).tolist() if page_size > 1 else [True] * len(self.first)
        self.index = per_page.to(device)

    def rows(self, buf: Any, page: int) -> Any:
        if self.block[page]:
            return buf[self.first[page] : self.first[page] + self.size]
        return buf.index_select(0, self.index[page])

    def put(self, buf: Any, page: int, rows: Any) -> None:
        rows = bitcast(rows, buf.dtype)
        if self.block[page]:
            buf[self.first[page] : self.first[page] + self.size].copy_(rows)
        else:
            buf.index_copy_(0, self.index[page], rows.to(buf.device))


class RemoteIO:
    """Through ReadKV and WriteKV, in the backend's session."""

    def __init__(self, client: Any, info: PoolInfo) -> None:
        self.client = client
        self.info = info

    def load(self, slots: Any, pages: list[HostPage], layers: list[int], session: Any) -> None:
        data = self.client.read_kv(self.info.model, slots, session=session, layers=layers)
        size = self.info.page_size
        for j, layer in enumerate(layers):
            for part in _parts(pages):
                rows = (data.k if part == K else data.v)[j]
                for i, (host, start) in enumerate(pages):
                    dst = host.page_view(part, layer, start)
                    dst.copy_(bitcast(rows[i * size : (i + 1) * size], dst.dtype))

    def store(self, slots: Any, pages: list[HostPage], layers: list[int], session: Any) -> None:
        import torch

        dtype = getattr(torch, self.info.dtype)
        rows: dict[str, list[Any]] = {K: [], V: []}
        for layer in layers:
            for part in _parts(pages):
                rows[part].append(
                    torch.cat(
                        [
                            bitcast(host.page_view(part, layer, start), dtype)
                            for host, start in pages
                        ]
                    )
                )
        if not rows[V]:  # MLA: the pool's V rows are unused, but WriteKV writes whole rows
            info = self.info
            rows[V] = [
                torch.zeros((len(slots), info.v_head_num, info.v_head_dim), dtype=dtype)
                for _ in layers
            ]
        self.client.write_kv(
            self.info.model, slots, k=rows[K], v=rows[V], session=session, layers=layers
        )

    def close(self) -> None:
        pass

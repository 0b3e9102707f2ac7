"""Loads issued layer by layer (the ``layerwise_load`` setting).

vLLM calls the connector's ``wait_for_layer_load(layer)`` just before each attention
layer reads its cache. With the engine's KV on a GPU, ``start_load_kv`` enqueues every
layer's copies (pool -> blocks), layer after layer, on a CUDA stream of their own and
records an event after each layer; the wait makes the engine's current stream wait
for that layer's event. Nothing waits on the host: layer 0's attention runs while
later layers are still copying.

Two kinds of copies behind one seam: ``CudaCopies`` (a side stream and its events)
and ``HostCopies`` (the engine's KV on the CPU: each copy is done when issued, so
there is nothing to wait for). ``StepLayers`` is the bookkeeping both share: which
layers this step issued, in order, and what a wait for a layer name does.

Copies from host memory overlap only from page-locked memory: ``pin_host`` registers
the mapped pool's shared memory with CUDA (``cudaHostRegister``) for as long as it is
mapped. torch is imported inside the functions only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("prefixcache.integrations.vllm")


class HostCopies:
    """Copies into host tensors: complete when issued; a mark is nothing to wait on."""

    device: Any = None

    @contextmanager
    def issuing(self) -> Iterator[None]:
        yield

    def record(self) -> Any:
        return None

    def wait(self, mark: Any) -> None:
        return None

    def drain(self) -> None:
        return None


class CudaCopies:
    """Copies on a CUDA stream of their own, after whatever the engine had queued."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    @contextmanager
    def issuing(self) -> Iterator[None]:
        import torch

        # After the engine's queued work: vLLM zeroes fresh blocks on its stream, and
        # an earlier forward may still read blocks this load now fills.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> Any:
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, mark: Any) -> None:
        import torch

        torch.cuda.current_stream(self.device).wait_event(mark)

    def drain(self) -> None:
        """Every copy issued so far complete, this stream's and the engine's (whole
        loads): a host wait, before a pool is unmapped."""
        import torch

        torch.cuda.synchronize(self.device)


def copies_for(device: Any) -> HostCopies | CudaCopies:
    """The copies for an engine whose KV tensors are on ``device``."""
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        return CudaCopies(device)
    return HostCopies()


class StepLayers:
    """One step's layer-wise loads: the layers issued, in order, each with its mark.

    Args:
        layer_of: every attention layer's name and the index of the cache it reads
            (layers that share one cache share its index).
        copies: what issued the copies (its marks are waited on).
    """

    def __init__(self, layer_of: dict[str, int], copies: HostCopies | CudaCopies) -> None:
        self.layer_of = layer_of
        self.copies = copies
        self._marks: dict[int, Any] = {}
        self._unknown: set[str] = set()

    def begin(self) -> None:
        """A new step: the last step's marks are dropped (its forward is launched)."""
        self._marks.clear()

    def issued(self, layer: int) -> None:
        """Every copy of cache ``layer`` is issued (layers in ascending order): mark it."""
        self._marks[layer] = self.copies.record()

    @property
    def order(self) -> list[int]:
        """The caches whose loads this step issued, in the order issued."""
        return list(self._marks)

    def wait(self, name: str) -> bool:
        """Make the engine wait (on its stream, not the host) for layer ``name``'s
        loads; False where this step loads nothing into it (a no-op). A name that was
        never registered waits for every layer: which cache it reads is not known."""
        layer = self.layer_of.get(name)
        if layer is None:
            if self._marks and name not in self._unknown:
                self._unknown.add(name)
                log.warning(
                    "prefixcache: wait_for_layer_load(%r): not a layer vLLM "
                    "registered; waiting for every layer's loads",
                    name,
                )
            self.wait_all()
            return bool(self._marks)
        if layer not in self._marks:
            return False
        self.copies.wait(self._marks[layer])
        return True

    def wait_all(self) -> None:
        """Make the engine wait for every load of the step (the last mark covers the
        earlier ones: one stream, in order)."""
        if self._marks:
            self.copies.wait(self._marks[next(reversed(self._marks))])


def pin_host(tensors: Iterable[Any]) -> list[int]:
    """Page-lock the host memory under ``tensors`` (whole storages, each once) so that
    copies from it to a GPU run asynchronously; the addresses pinned, for
    ``unpin_host``. A storage that cannot be pinned is left as it is (its copies still
    work, staged through pageable memory), said once in the log."""
    import torch

    cudart = torch.cuda.cudart()
    done: list[int] = []
    seen: set[int] = set()
    for tensor in tensors:
        if tensor is None or tensor.device.type != "cpu" or tensor.is_pinned():
            continue
        storage = tensor.untyped_storage()
        ptr, size = int(storage.data_ptr()), int(storage.nbytes())
        if ptr in seen or not size:
            continue
        seen.add(ptr)
        result = cudart.cudaHostRegister(ptr, size, 0)
        if _code(result):
            log.warning(
                "prefixcache: cannot pin the pool's %d bytes for the GPU (CUDA "
                "error %s): layer-wise loads copy through pageable memory",
                size,
                _code(result),
            )
            continue
        done.append(ptr)
    return done


def unpin_host(ptrs: Iterable[int]) -> None:
    """Undo ``pin_host`` (before the memory is unmapped)."""
    ptrs = list(ptrs)
    if not ptrs:
        return
    import torch

    cudart = torch.cuda.cudart()
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)


def _code(result: Any) -> int:
    return int(getattr(result, "value", result))

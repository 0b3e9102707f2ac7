"""KV bytes moved per second, against the copy they should match.

For a model geometry (default: 32 layers, 8 KV heads, head dim 128, bfloat16), pages of
16 and 64 tokens and prompts of several lengths, it measures in one run:

- ``vllm_load`` / ``vllm_save``: the vLLM connector's worker core (``WorkerCore``)
  loading a request from the mapped pool (shared memory) into vLLM's blocks and saving
  it back, for the CPU backend's layout (``cpu_vec``) and FlashAttention's (``bhn2d``);
  vLLM's block is the page size and a request's blocks are scattered, as they are in a
  busy engine. Loads run without the verifying Match, saves under their write fence.
- ``sglang_get`` / ``sglang_set``: the SGLang backend's ``batch_get_v1`` /
  ``batch_set_v1`` (``HiCacheCore.get`` / ``set``, RPCs included) against a host pool
  in SGLang's ``layer_first`` layout, mapped pool;
- ``readkv`` / ``writekv``: ReadKV / WriteKV over gRPC, on a unix socket and on TCP
  (127.0.0.1): a worker without the pool mapped.
- ``disk_promote`` / ``disk_demote``: the disk tier (``kv_disk.py``): pages read from
  disk into the pool as a lookup does, and evicted pages written to disk, against a
  plain ``O_DIRECT`` read and write of the same bytes on the same file system
  (``--disk-dir``, default the system's temporary directory), at ``--disk-pages`` page
  counts (1, 64 and 4096 pages of 16 tokens, ``--disk-layers`` layers: 4 by default, so
  4096 pages are 1 GiB; the pool and the plain buffers hold as much again).

Ceilings, in the same run: a plain torch copy of the same bytes between the same two
buffers (pool and vLLM cache, pool and host pool), and a raw socket transfer of the same
bytes (ReadKV's and WriteKV's). Beside ReadKV on the unix socket, the gRPC floor: the
same bytes streamed by a bare grpc.aio server in 1 MiB messages (``grpc_stream_floor.py``),
what Python gRPC itself allows. Each number is the best of ``--repeat`` runs (the
machine is shared). The servers are ``prefixcache serve`` subprocesses.

    python bench/kv_bandwidth.py --quick --json kv.json

``--device cuda`` (a GPU machine) measures ``vllm_load`` only, whole and layer-wise,
with vLLM's blocks on the GPU (``kv_layerwise.py``).

``--quick`` runs 4 layers (not 32), prompts of 2k and 8k tokens. The full run
(2k, 8k, 16k tokens; ``--tokens 32768`` for more) needs about 3 pools of
``tokens x 128 KiB`` in /dev/shm: check ``df -h /dev/shm`` first.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import torch  # noqa: E402

from bench.grpc_servers import _SERVE, _SERVER_PATHS, ServerProcess  # noqa: E402
from bench.grpc_stream_floor import reader as grpc_floor_reader  # noqa: E402
from bench.kv_ceilings import RawSocket, flat_copy, paired_seconds  # noqa: E402
from prefixcache.client import PrefixCacheClient  # noqa: E402
from prefixcache.integrations.sglang import HiCacheCore, HostLayout, Settings  # noqa: E402
from prefixcache.integrations.vllm.attn_backends import BackendInfo  # noqa: E402
from prefixcache.integrations.vllm.config import ConnectorConfig  # noqa: E402
from prefixcache.integrations.vllm.layout import gather_blocks  # noqa: E402
from prefixcache.integrations.vllm.meta import LoadOp, SaveOp, StepMeta  # noqa: E402
from prefixcache.integrations.vllm.worker import WorkerCore  # noqa: E402

HEADS, DIM, DTYPE = 8, 128, torch.bfloat16
_V1 = "vllm.v1.attention.backends."
LAYOUTS = {
    "bhn2d": BackendInfo(_V1 + "flash_attn.FlashAttentionBackend", DIM),
    "cpu_vec": BackendInfo(_V1 + "cpu_attn.CPUAttentionBackend", DIM, "vec"),
}


def _pool_yaml(name: str, page: int, size: int, layers: int) -> str:
    return (
        f"  - name: {name}\n    kind: radix\n    page_size: {page}\n"
        f"    pool: {{size: {size}, layers: {layers}, k_heads: {HEADS}, "
        f"k_head_dim: {DIM}, dtype: bfloat16}}\n"
    )


def start_server(tmp: Path, tag: str, listen: str, models: str) -> ServerProcess:
    config = tmp / f"{tag}.yaml"
    # The SGLang backend looks pages up by hash: that needs the change log.
    config.write_text("server:\n  change_log_capacity: 65536\nmodels:\n" + models)
    argv = [
        sys.executable,
        "-c",
        _SERVE,
        "serve",
        "--config",
        str(config),
        "--listen",
        listen,
        *([] if listen.startswith("unix:") else ["--insecure"]),
        "--metrics-port",
        "-1",
        "--grace-period",
        "1",
        "--log-level",
        "warning",
    ]
    if listen.startswith("unix:"):
        return ServerProcess(
            f"prefixcache serve ({tag})", argv, Path(listen[5:]), tmp / f"{tag}.log"
        )
    return _tcp_server(argv, listen, tmp / f"{tag}.log")


def _tcp_server(argv: list[str], listen: str, log: Path) -> ServerProcess:
    # ServerProcess starts servers on unix sockets; a TCP one is started and waited on
    # the same way, with its own target.
    proc = ServerProcess.__new__(ServerProcess)
    proc.name, proc.target, proc.log_path = "prefixcache serve (tcp)", listen, log
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([*_SERVER_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    proc._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
    proc.proc = subprocess.Popen(
        argv, env=env, stdout=proc._log, stderr=subprocess.STDOUT, cwd=_REPO
    )
    proc._wait_ready()
    return proc


def _row(path: str, nbytes: int, seconds: float, ceiling_s: float, **extra: Any) -> dict:
    gbs, ceil = nbytes / seconds / 1e9, nbytes / ceiling_s / 1e9
    return {
        "path": path,
        "bytes": nbytes,
        "gb_per_s": round(gbs, 3),
        "ceiling_gb_per_s": round(ceil, 3),
        "ratio": round(gbs / ceil, 3),
        **extra,
    }


def _layer_pairs(
    pool: Any, layers: int, first: int, n: int, other: list[Any], to_pool: bool
) -> list[tuple[Any, Any]]:
    """(dst, src) flat byte views: each layer's K and V rows of ``n`` pool slots from
    ``first`` and the same number of bytes of the other buffer of that layer."""
    pairs = []
    for layer in range(layers):
        done = 0
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            src = buf[first : first + n].view(torch.uint8).reshape(-1)
            dst = other[layer].view(torch.uint8).reshape(-1)[done : done + src.numel()]
            done += src.numel()
            pairs.append((src, dst) if to_pool else (dst, src))
    return pairs


def bench_vllm(
    client: PrefixCacheClient,
    target: str,
    model: str,
    page: int,
    n: int,
    layers: int,
    repeat: int,
    verify: bool,
    floor: Any = None,
) -> list[dict]:
    rows = []
    session = client.session(60, name="kv-bandwidth")
    alloc = client.alloc(model, n, session=session)
    slots = array("q", bytes(alloc.slots)) if not isinstance(alloc.slots, array) else alloc.slots
    first = slots[0]
    contiguous = list(slots) == list(range(first, first + n))
    pool = client.attach_pool(model)
    nbytes = n * layers * 2 * HEADS * DIM * DTYPE.itemsize
    try:
        for layout, backend in LAYOUTS.items():
            blocks = n // page + 4
            caches = {
                f"model.layers.{i}.self_attn.attn": torch.randn(blocks, HEADS, page, 2 * DIM).to(
                    DTYPE
                )
                for i in range(layers)
            }
            worker = WorkerCore(
                ConnectorConfig(model=model, target=target, transfer="attach", verify_loads=False),
                page,
            )
            worker.register(caches, backend)
            order = torch.randperm(blocks - 1) + 1  # block 0 is vLLM's null block
            save_ids = array("q", order[: n // page].tolist())
            load_ids = array("q", order[-(n // page) :].tolist())
            save = StepMeta(
                saves=[SaveOp("s", save_ids, 0, slots, alloc.server_epoch, session.session_id)]
            )
            load = StepMeta(
                loads=[LoadOp("l", load_ids, 0, n, slots, alloc.server_epoch, session.session_id)]
            )
            tensors = list(caches.values())
            # The ceiling: the same bytes, plainly, between the pool's rows and vLLM's cache.
            first_rows = first if contiguous else 1
            to_pool = flat_copy(_layer_pairs(pool, layers, first_rows, n, tensors, True))
            to_cache = flat_copy(_layer_pairs(pool, layers, first_rows, n, tensors, False))
            t_save, c_save = paired_seconds(
                lambda w=worker, m=save: w.start_step(m), to_pool, repeat
            )
            if verify:  # the ceiling's copy ran last: copy once more, then check
                worker.start_step(save)
                _verify_vllm(worker, pool, slots, save_ids, page, n)
            t_load, c_load = paired_seconds(
                lambda w=worker, m=load: w.start_step(m), to_cache, repeat
            )
            if verify:
                worker.start_step(load)
                _verify_vllm(worker, pool, slots, load_ids, page, n)
            if worker.failed_saves or worker.failed_loads:
                raise RuntimeError(
                    f"{layout}: {worker.failed_saves} saves and {worker.failed_loads} loads failed"
                )
            extra = {"layout": layout, "page_size": page, "tokens": n, "layers": layers}
            rows.append(_row("vllm_load", nbytes, t_load, c_load, **extra))
            rows.append(_row("vllm_save", nbytes, t_save, c_save, **extra))
            worker.close()
            del caches, tensors
        rows += bench_rpc(
            client, model, slots, session, layers, n, repeat, "unix", pool, verify, floor
        )
    finally:
        pool.close()
        client.free(model, slots, session=session, server_epoch=alloc.server_epoch)
        session.close()
    return rows


def _verify_vllm(
    worker: WorkerCore, pool: Any, slots: array, block_ids: array, page: int, n: int
) -> None:
    """The request's tokens in ``block_ids`` are the pool rows of ``slots``, byte for byte
    (read through the layout's views, the slow way)."""
    index = torch.frombuffer(slots, dtype=torch.int64)
    pos = torch.arange(n)
    for layer, view in enumerate(worker.layers):
        for side, buf in ((view.k, pool.k_buffer[layer]), (view.v, pool.v_buffer[layer])):
            want = buf.index_select(0, index)
            blocks = torch.tensor(list(block_ids))[pos // page]
            got = gather_blocks(side, blocks, pos % page)
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                raise RuntimeError(f"layer {layer} ({view.layout}): bytes differ")


def bench_rpc(
    client: PrefixCacheClient,
    model: str,
    slots: array,
    session: Any,
    layers: int,
    n: int,
    repeat: int,
    transport: str,
    pool: Any | None,
    verify: bool,
    floor: Any = None,
) -> list[dict]:
    nbytes = n * layers * 2 * HEADS * DIM * DTYPE.itemsize
    ks = [torch.randn(n, HEADS, DIM).to(DTYPE) for _ in range(layers)]
    vs = [torch.randn(n, HEADS, DIM).to(DTYPE) for _ in range(layers)]

    def write() -> None:
        client.write_kv(model, slots, ks, vs, session=session)

    staging: list[Any] = [None]

    def read() -> Any:
        # As a worker reads: into its staging buffers (the raw socket's sink is reused too).
        staging[0] = client.read_kv(model, slots, session=session, out=staging[0])
        return staging[0]

    if verify:
        write()
        data = read()
        same = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(data.k + data.v, ks + vs, strict=True)
        )
        if pool is not None:
            index = torch.frombuffer(slots, dtype=torch.int64)
            same = same and all(
                torch.equal(pool.k_buffer[i].index_select(0, index), ks[i]) for i in range(layers)
            )
        if not same:
            raise RuntimeError(f"ReadKV/WriteKV over {transport}: bytes differ")
    raw = RawSocket(transport)
    try:
        t_read, c_read = paired_seconds(read, raw.transfer(nbytes), repeat)
        t_write, c_write = paired_seconds(write, raw.transfer(nbytes), repeat)
        floor_gbs = None
        if floor is not None:  # Python gRPC's own ceiling: bytes streamed, nothing else
            t_floor, _ = paired_seconds(lambda: floor(nbytes, 1 << 20), read, repeat)
            floor_gbs = round(nbytes / t_floor / 1e9, 3)
    finally:
        raw.close()
    extra = {"transport": transport, "tokens": n, "layers": layers}
    read_row = _row("readkv", nbytes, t_read, c_read, **extra)
    if floor_gbs is not None:
        read_row["grpc_floor_gb_per_s"] = floor_gbs
    return [read_row, _row("writekv", nbytes, t_write, c_write, **extra)]


def bench_sglang(
    client: PrefixCacheClient,
    target: str,
    model: str,
    page: int,
    n: int,
    layers: int,
    repeat: int,
    verify: bool,
) -> list[dict]:
    host_k = torch.randn(layers, 2 * n, HEADS, DIM).to(DTYPE)
    host_v = torch.randn(layers, 2 * n, HEADS, DIM).to(DTYPE)
    core = HiCacheCore(Settings(target=target, model=model, transfer="attach"))
    core.register_host_pool(HostLayout.of_buffers("layer_first", page, host_k, host_v))
    indices = torch.arange(n, dtype=torch.int64)
    fresh = itertools.count()
    keys: list[list[str]] = [[]]

    def put() -> None:
        batch = next(fresh)
        keys[0] = [
            hashlib.sha256(f"{model}-{n}-{batch}-{i}".encode()).hexdigest()
            for i in range(n // page)
        ]
        if not all(core.set(keys[0], indices)):
            raise RuntimeError("batch_set_v1 stored nothing")

    def get() -> None:
        if not all(core.get(keys[0], indices + n)):
            raise RuntimeError("batch_get_v1 found nothing")

    pool = client.attach_pool(model)
    to_pool, to_host = [], []
    for i in range(layers):
        for buf, host in ((pool.k_buffer[i], host_k[i]), (pool.v_buffer[i], host_v[i])):
            rows = buf[1 : n + 1].view(torch.uint8).reshape(-1)
            to_pool.append((rows, host[:n].view(torch.uint8).reshape(-1)))
            to_host.append((host[n:].view(torch.uint8).reshape(-1), rows))
    try:
        # The ceilings copy between pool rows and the host positions the calls read
        # (set) or write (get) ...
        t_set, c_set = paired_seconds(put, flat_copy(to_pool), repeat)
        t_get, c_get = paired_seconds(get, flat_copy(to_host), repeat)
        # ... so the checked copy runs last.
        put()
        get()
        if verify and not (
            torch.equal(host_k[:, n:].view(torch.uint8), host_k[:, :n].view(torch.uint8))
            and torch.equal(host_v[:, n:].view(torch.uint8), host_v[:, :n].view(torch.uint8))
        ):
            raise RuntimeError("batch_get_v1 did not bring back what batch_set_v1 stored")
    finally:
        core.close()
        pool.close()
    nbytes = n * layers * 2 * HEADS * DIM * DTYPE.itemsize
    extra = {"layout": "layer_first", "page_size": page, "tokens": n, "layers": layers}
    return [
        _row("sglang_get", nbytes, t_get, c_get, **extra),
        _row("sglang_set", nbytes, t_set, c_set, **extra),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 2k and 8k tokens")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=str, default=None, help="comma-separated")
    ap.add_argument("--pages", type=str, default="16,64")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the byte-for-byte checks of the first prompt length",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--disk-pages",
        type=str,
        default="1,64,4096",
        help="page counts of the disk tier's rows (comma-separated; '' for none)",
    )
    ap.add_argument("--disk-layers", type=int, default=4)
    ap.add_argument(
        "--disk-dir", type=Path, default=None, help="the file system the disk tier's rows run on"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: vLLM's blocks on the GPU, vllm_load whole and layer-wise "
        "only (kv_layerwise.py)",
    )
    args = ap.parse_args(argv)
    layers = args.layers or (4 if args.quick else 32)
    tokens = [
        int(x)
        for x in (args.tokens or ("2048,8192" if args.quick else "2048,8192,16384")).split(",")
    ]
    pages = [int(x) for x in args.pages.split(",")]
    repeat = args.repeat or 3
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if any(n % p for n in tokens for p in pages):
        ap.error("every prompt length must be a multiple of every page size")
    size = max(tokens) + 2 * max(pages)
    if args.device == "cuda":
        rows = _cuda_rows(tokens, pages, size, layers, repeat)
    else:
        rows = _cpu_rows(args, tokens, pages, size, layers, repeat)
        counts = [int(x) for x in args.disk_pages.split(",") if x]
        if counts:
            from bench.kv_disk import bench_disk

            with tempfile.TemporaryDirectory(prefix="kvbw-disk-", dir=args.disk_dir) as d:
                rows += bench_disk(Path(d), args.disk_layers, 16, counts, repeat, _row)
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _cuda_rows(
    tokens: list[int], pages: list[int], size: int, layers: int, repeat: int
) -> list[dict]:
    from bench.kv_layerwise import bench_vllm_cuda

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvbw-") as tmp_name:
        tmp = Path(tmp_name)
        models = "".join(_pool_yaml(f"p{p}", p, size, layers) for p in pages)
        server = start_server(tmp, "unix", f"unix:{tmp / 'pc.sock'}", models)
        try:
            with PrefixCacheClient(server.target, timeout=60) as client:
                for n in tokens:
                    for page in pages:
                        rows += bench_vllm_cuda(
                            client,
                            server.target,
                            f"p{page}",
                            page,
                            n,
                            layers,
                            HEADS,
                            DIM,
                            repeat,
                            _row,
                        )
        finally:
            server.stop()
    return rows


def _cpu_rows(
    args: argparse.Namespace,
    tokens: list[int],
    pages: list[int],
    size: int,
    layers: int,
    repeat: int,
) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvbw-") as tmp_name:
        tmp = Path(tmp_name)
        models = "".join(_pool_yaml(f"p{p}", p, size, layers) for p in pages)
        server = start_server(tmp, "unix", f"unix:{tmp / 'pc.sock'}", models)
        port = _free_port()
        tcp = start_server(tmp, "tcp", f"127.0.0.1:{port}", _pool_yaml("tcp", 16, size, layers))
        floor_server = ServerProcess(
            "gRPC floor",
            [
                sys.executable,
                str(_REPO / "bench" / "grpc_stream_floor.py"),
                f"unix:{tmp / 'floor.sock'}",
            ],
            tmp / "floor.sock",
            tmp / "floor.log",
        )
        floor_channel, floor = grpc_floor_reader(floor_server.target)
        try:
            with (
                PrefixCacheClient(server.target, timeout=60) as client,
                PrefixCacheClient(tcp.target, timeout=60) as tcp_client,
            ):
                for n in tokens:
                    verify = not args.no_verify and n == tokens[0]
                    for page in pages:
                        model = f"p{page}"
                        rows += bench_vllm(
                            client, server.target, model, page, n, layers, repeat, verify, floor
                        )
                        rows += bench_sglang(
                            client, server.target, model, page, n, layers, repeat, verify
                        )
                        client.reset(model)
                    session = tcp_client.session(60, name="kv-bandwidth-tcp")
                    alloc = tcp_client.alloc("tcp", n, session=session)
                    rows += bench_rpc(
                        tcp_client,
                        "tcp",
                        alloc.slots,
                        session,
                        layers,
                        n,
                        repeat,
                        "tcp",
                        None,
                        verify,
                    )
                    session.close()
        finally:
            floor_channel.close()
            floor_server.stop()
            server.stop()
            tcp.stop()
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _print(rows: list[dict]) -> None:
    if not rows:
        return
    print("| path | where | page | tokens | MB | GB/s | ceiling GB/s | ratio | gRPC floor |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        where = " ".join(filter(None, (r.get("layout") or r.get("transport"), r.get("mode"))))
        if "pages" in r:
            where = f"{r['pages']} pages" + ("" if r["direct_io"] else " (buffered)")
        print(
            f"| {r['path']} | {where} | {r.get('page_size', '')} | {r['tokens']} | "
            f"{r['bytes'] / 1e6:.1f} | {r['gb_per_s']:.2f} | {r['ceiling_gb_per_s']:.2f} | "
            f"{r['ratio']:.2f} | {r.get('grpc_floor_gb_per_s') or ''} |"
        )


if __name__ == "__main__":
    sys.exit(main())

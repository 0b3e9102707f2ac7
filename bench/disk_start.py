"""How long ``prefixcache serve`` takes to be ready with a large disk tier, against a
cold start (the same config, an empty disk tier) and a start without one.

For each size (``--tokens``: 1 M and 10 M tokens' worth by default; tiny rows, so the
pages file stays small: 1 layer, 1 head of 8 dims, float16, pages of 16 tokens, 512
bytes a page), a server in this process fills its disk tier through the real store
(``put_from`` in batches, as the write thread does) and stops cleanly (the index file
written); then ``prefixcache serve`` subprocesses are started and timed until they
answer ``ListModels``, alternating the cases, best of ``--repeat``. ``killed`` starts
after a SIGKILL-like stop: the last pages only in the journal (the store closed without
its index write). The goal: ready within 2x the cold start.

    python bench/disk_start.py --json start.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import yaml  # noqa: E402

from prefixcache.server.app import PrefixCacheServer  # noqa: E402
from prefixcache.server.config import load_config  # noqa: E402

PAGE = 16
BATCH = 4096


def _config(tmp: Path, tokens: int, disk: Path | None) -> dict[str, Any]:
    pages = tokens // PAGE
    server: dict[str, Any] = {"shm_dir": "", "metrics_port": -1}
    if disk is not None:
        # Page slots, their index twice and the journal: 512 + 232 bytes a page.
        server["disk"] = {"path": str(disk), "bytes": pages * 800 + (64 << 20)}
    return {
        "server": server,
        "models": [
            {
                "name": "m",
                "page_size": PAGE,
                "pool": {
                    "size": 65536,
                    "layers": 1,
                    "k_heads": 1,
                    "k_head_dim": 8,
                    "dtype": "float16",
                },
            }
        ],
    }


def _fill(tmp: Path, tokens: int, disk: Path, crash: bool) -> int:
    """Write ``tokens // PAGE`` pages to the disk tier of a server in this process;
    returns the pages held. ``crash``: the store is left without its index write."""
    path = tmp / "fill.yaml"
    path.write_text(yaml.safe_dump(_config(tmp, tokens, disk)))
    config = load_config(str(path), env={})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(3600)

    from dataclasses import replace

    config = replace(config, server=replace(config.server, listen=f"unix:{tmp / 'f.sock'}"))
    server = PrefixCacheServer(config)
    call(server.start())
    mt = server.tier.tiers[0].models["m"]
    store = mt.backend
    ptrs, sizes = mt.staging.parts([0])
    seal = mt.seal_slots.ptrs(mt.seal_slots.take(1))[0]
    part = [[*ptrs[0], seal]]
    size = [[*sizes[0], 32]]
    pages = tokens // PAGE
    for at in range(0, pages, BATCH):
        n = min(BATCH, pages - at)
        store.put_from([f"k/{at + i}" for i in range(n)], part * n, size * n)
    held = store.pages_held
    if crash:
        store.closed = True  # as after SIGKILL: the index file is not written anew
        store.files.close()
    call(server.stop(0.1))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    return held


def _ready_seconds(tmp: Path, name: str, config: dict[str, Any]) -> float:
    folder = tmp / name
    folder.mkdir(exist_ok=True)
    (folder / "pc.yaml").write_text(yaml.safe_dump(config))
    sock = folder / "pc.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(_REPO / "server"), str(_REPO / "client")]),
        OMP_NUM_THREADS="1",
    )
    start = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache.server.cli",
            "serve",
            "--config",
            str(folder / "pc.yaml"),
            "--listen",
            f"unix:{sock}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from prefixcache.client import PrefixCacheClient

    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: serve exited {proc.returncode}")
            if sock.exists():
                try:
                    with PrefixCacheClient(f"unix:{sock}", timeout=1) as client:
                        client.list_models()
                    return time.perf_counter() - start
                except Exception:
                    pass
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1000000,10000000", help="comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="the file system to run on")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        with tempfile.TemporaryDirectory(prefix="disk-start-", dir=args.dir) as name:
            tmp = Path(name)
            full, empty, killed = tmp / "full", tmp / "empty", tmp / "killed"
            for d in (full, empty, killed):
                d.mkdir()
            t0 = time.perf_counter()
            held = _fill(tmp, tokens, full, crash=False)
            fill_s = time.perf_counter() - t0
            _fill(tmp, tokens, killed, crash=True)
            cases = {
                "none": _config(tmp, tokens, None),
                "empty": _config(tmp, tokens, empty),
                "full": _config(tmp, tokens, full),
                "killed": _config(tmp, tokens, killed),
            }
            best = {case: float("inf") for case in cases}
            for r in range(args.repeat + 1):
                for case, config in cases.items():
                    seconds = _ready_seconds(tmp, f"{case}-{r}", config)
                    if r or not args.repeat:  # the first round warms the caches
                        best[case] = min(best[case], seconds)
            row = {
                "tokens": tokens,
                "pages": held,
                "fill_seconds": round(fill_s, 2),
                **{f"{case}_s": round(s, 3) for case, s in best.items()},
                "full_over_empty": round(best["full"] / best["empty"], 2),
                "killed_over_empty": round(best["killed"] / best["empty"], 2),
                "full_over_none": round(best["full"] / best["none"], 2),
            }
            rows.append(row)
            print(json.dumps(row))
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

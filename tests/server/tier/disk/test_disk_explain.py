"""The disk tier's part of "why no hit?", through real ``prefixcache serve`` processes:
the Explain RPC and ``prefixcache explain`` say what the disk holds after the pool's
hit and what a lookup would do with it, and what the last lookup of the request there
did: pages promoted (a hit from disk), not on disk, a read past its deadline, a page
that failed its seal, no room for the read; the lookups are counted by those results."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from disk_harness import MODEL, PS, cache, demote, disk_config, read, tokens_of
from harness import pb, stub_for, toks
from tier_harness import CLI, Node

from prefixcache.client import PrefixCacheClient

LOOKUPS = r'prefixcache_disk_lookups_total\{{.*result="{}".*\}}'


def _explain(node: Node, tokens: list[int]) -> Any:
    channel, stub = stub_for(node.address)
    with channel:
        reply = stub.Explain(pb.ExplainRequest(model=MODEL, token_ids=toks(tokens)))
    assert [t.tier for t in reply.tiers] == ["disk"]
    return reply


def _node(tmp: Path, name: str, **disk: Any) -> Node:
    path = tmp / f"{name}-disk"
    path.mkdir()
    node = Node(tmp, name, disk_config(path, **disk))
    node.wait(r'prefixcache_disk_capacity_bytes\{model="m"\}', 1)
    return node


def _cli_explain(node: Node, tokens: list[int], tmp: Path) -> str:
    prompt = tmp / "prompt.json"
    prompt.write_text(json.dumps(tokens))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    out = subprocess.run(
        [*CLI, "explain", "--target", node.address, "--model", MODEL, "--tokens-file", str(prompt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_explain_says_what_the_disk_holds_and_what_its_lookups_did(tmp_path: Path) -> None:
    node = _node(tmp_path, "a")
    try:
        on_disk, never, bad = tokens_of(1), tokens_of(2), tokens_of(3)
        demote(node, on_disk, seed=1)
        reply = _explain(node, on_disk)
        assert reply.prefix_len == 0
        (part,) = reply.tiers
        assert (part.tokens, part.state, part.last) == (len(on_disk), "promote", "")
        out = _cli_explain(node, on_disk, tmp_path)
        assert f"disk tier: {len(on_disk)} tokens after the hit held there; promote" in out

        hit, _ = read(node, on_disk)  # promoted: a hit from disk
        assert hit == len(on_disk)
        (part,) = _explain(node, on_disk).tiers
        assert (part.state, part.last, part.last_tokens) == ("hit", "disk", len(on_disk))
        out = _cli_explain(node, on_disk, tmp_path)
        assert f"its last lookup of this request: disk: read {len(on_disk)} tokens" in out
        assert node.metric(LOOKUPS.format("disk")) == 1

        (part,) = _explain(node, never).tiers
        assert (part.tokens, part.state, part.last) == (0, "not_held", "")
        with PrefixCacheClient(node.address, timeout=10) as client:
            assert client.match(MODEL, never).prefix_len == 0
        (part,) = _explain(node, never).tiers
        assert (part.state, part.last) == ("not_held", "miss")
        assert node.metric(LOOKUPS.format("miss")) >= 1

        # A page whose bytes changed on disk: its seal fails, the lookup is refused.
        demote(node, bad, seed=3)
        (folder,) = [p for p in (tmp_path / "a-disk").iterdir() if p.is_dir()]
        with open(folder / "pages", "r+b") as f:
            data = bytearray(f.read())
            for at in range(0, len(data), 64):  # every page on disk
                data[at] ^= 0xFF
            f.seek(0)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with PrefixCacheClient(node.address, timeout=10) as client:
            assert client.match(MODEL, bad).prefix_len == 0
        (part,) = _explain(node, bad).tiers
        assert part.last == "refused" and part.state == "not_held"  # removed
        assert node.metric(LOOKUPS.format("refused")) == 1
        out = _cli_explain(node, bad, tmp_path)
        assert "refused: the first page failed its seal check" in out
    finally:
        assert node.stop() == 0


def test_a_read_past_its_deadline_is_a_timeout(tmp_path: Path) -> None:
    # A deadline no read can meet: a microsecond, with no time for the bytes.
    node = _node(tmp_path, "t", timeout=1e-6, min_fetch_bandwidth=1e18)
    try:
        tokens = tokens_of(4)
        demote(node, tokens, seed=4)
        with PrefixCacheClient(node.address, timeout=10) as client:
            assert client.match(MODEL, tokens).prefix_len == 0
        (part,) = _explain(node, tokens).tiers
        assert part.tokens == len(tokens) and part.last == "timeout"
        assert node.metric(LOOKUPS.format("timeout")) == 1
        assert node.metric(LOOKUPS.format("error")) == 0
    finally:
        assert node.stop() == 0


def test_no_room_for_a_read_is_capacity(tmp_path: Path) -> None:
    node = _node(tmp_path, "c", max_fetch_slots=PS - 1)  # less than a page
    try:
        tokens = tokens_of(5)
        demote(node, tokens, seed=5)
        with PrefixCacheClient(node.address, timeout=10) as client:
            assert client.match(MODEL, tokens).prefix_len == 0
        (part,) = _explain(node, tokens).tiers
        assert (part.tokens, part.state, part.last) == (len(tokens), "capacity", "capacity")
        assert node.metric(LOOKUPS.format("capacity")) == 1
        cache(node, tokens, seed=5)  # in the pool again: nothing left for the disk
        (part,) = _explain(node, tokens).tiers
        assert part.state == "hit" and _explain(node, tokens).prefix_len == len(tokens)
    finally:
        assert node.stop() == 0

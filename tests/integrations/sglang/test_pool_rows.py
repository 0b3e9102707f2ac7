"""What ``batch_set_v1`` stores is each token's K and V in the pool's own rows: read
back through ReadKV (as any other client, or another engine, reads the pool), row ``t``
of a stored page is the host pool's row of that page's token ``t``, per layer, for
every host layout and both transfers. A round trip through the backend alone cannot
show this (a consistent mix-up comes back intact); the other direction, pool rows
written by WriteKV into host rows, is ``test_core.test_token_pages_are_found_by_hash``.

The same check with K/V computed by transformers for a real model is
``tests/e2e/test_sglang_kv.py``.
"""

from __future__ import annotations

import pytest
import torch
from hicache_hosts import LAYERS, MHA_LAYOUTS, MLA_LAYOUTS, PAGE, HostPool, host_indices, make_core

from prefixcache.cache import hash_token_ids

CASES = [(layout, False, transfer) for layout in MHA_LAYOUTS for transfer in ("attach", "rpc")] + [
    (layout, True, transfer) for layout in MLA_LAYOUTS for transfer in ("attach", "rpc")
]


def chain(tokens: list[int]) -> list[str]:
    keys: list[str] = []
    for i in range(0, len(tokens), PAGE):
        keys.append(hash_token_ids(tokens[i : i + PAGE], keys[-1] if keys else None))
    return keys


@pytest.mark.parametrize(
    ("layout", "mla", "transfer"),
    CASES,
    ids=[f"{'mla' if c[1] else 'mha'}-{c[0]}-{c[2]}" for c in CASES],
)
def test_stored_pages_are_rows_per_token(
    server, client, cores, layout: str, mla: bool, transfer: str
) -> None:
    seed = CASES.index((layout, mla, transfer))
    pool = HostPool(
        layout,
        mla=mla,
        heads=1 if mla else 2,
        dim=12 if mla else 8,
        dtype=torch.bfloat16 if mla else torch.float16,
        seed=seed,
    )
    model = "mla" if mla else "kv"
    core = make_core(server.address, pool, transfer=transfer)
    cores.append(core)
    tokens = [(seed * 131 + i * 17) % 30000 + 5000 for i in range(4 * PAGE)]
    keys = chain(tokens)
    at = [9, 2, 14, 5]  # host pages out of order: a page lands at its own keys' slots
    assert core.set(keys[:1], host_indices(at[:1])) == [True]
    assert core.set(keys[1:], host_indices(at[1:]), keys[0]) == [True] * 3
    assert type(core._io).__name__ == {"attach": "AttachedIO", "rpc": "RemoteIO"}[transfer]

    with client.session() as session:
        found = client.get_pages(model, keys, session=session)
        try:
            assert found.found_pages == len(keys)
            data = client.read_kv(model, found.slot_indices, session=session)
        finally:
            for lock_id in found.lock_ids:
                client.unlock(lock_id, session=session)
    positions = host_indices(at).tolist()
    wrong = []
    for layer in range(LAYERS):
        for part, rows in (("k", data.k[layer]), ("v", data.v[layer])):
            if mla and part == "v":
                continue  # an MLA host pool has no V; the pool's V rows are unused
            for t, position in enumerate(positions):
                if not torch.equal(rows[t], pool.row(part, layer, position)):
                    wrong.append((layer, part, t))
    assert not wrong, f"{len(wrong)} rows differ, first {wrong[:4]}"
    server.check_integrity()

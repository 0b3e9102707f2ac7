"""SetPages of a long chain leaves other clients served (nothing a client does may stall
the others).

A client that holds many slots could send one SetPages storing a chain of 200k pages:
its checks, its lookups, the walk of the path it extends and the insert of every page
ran in one loop turn (0.46-0.53 s of CPU here), every other call waiting behind it.
Now it works in slices (page_store.SLICE pages' worth of work) with the loop free
between them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from harness import ServerThread, make_config, pb, stub_for
from stall_harness import HELD, LoopWatch, Victim

from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.engine.hash_pages import HashPages

# One client storing a chain in two SetPages, from a process of its own (its 8 MiB
# requests are not serialized on this process's GIL): the chain's first half, then its
# second half after it (prior_hash: stored on the first half's path, which the server
# walks). Prints each call's states, as counts of (missing, stored, held).
SET_FLOOD = """
import os, sys, grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc
address, path = sys.argv[1:3]
data = open(path, "rb").read()
stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel(address))
session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600)).session_id
pages = len(data) // 32
half = pages // 2 * 32
slots = stub.Alloc(pb.AllocRequest(model="m", num_slots=pages, session_id=session),
                   timeout=300).slot_indices
for prior, hashes, sent in ((b"", data[:half], slots[:half // 4]),
                            (data[half - 32:half], data[half:], slots[half // 4:])):
    states = stub.SetPages(pb.SetPagesRequest(
        model="m", extra_key="a", prior_hash=prior, page_hashes=hashes,
        slot_indices=sent, session_id=session), timeout=300).states
    print(states.count(0), states.count(1), states.count(2))
stub.CloseSession(pb.CloseSessionRequest(session_id=session))
"""


def test_a_long_chain_stored_by_hash_goes_in_slices(tmp_path) -> None:
    chain = 200_000  # one 200k-page chain, page size 1
    models = (
        ModelConfig(
            name="m",
            page_size=1,
            pool=PoolConfig(size=chain + 4096, layers=1, k_heads=1, k_head_dim=4),
        ),
    )
    srv = ServerThread(make_config(tmp_path, models), check_integrity=False)
    engine = srv.service.engines["m"]
    try:
        path = tmp_path / "hashes"
        path.write_bytes(os.urandom(32 * chain))
        victim = Victim(srv.address)
        with LoopWatch(srv) as watch:
            victim.start()
            time.sleep(0.2)
            flooder = subprocess.Popen(
                [sys.executable, "-c", SET_FLOOD, srv.address, str(path)],
                stdout=subprocess.PIPE,
                text=True,
            )
            out = flooder.communicate(timeout=300)[0]
            answered = victim.finish()
        print(
            f"{victim.report()}; "
            f"longest loop callback {watch.worst * 1000:.0f} ms of CPU: {watch.what}"
        )
        assert flooder.returncode == 0
        assert out.split("\n")[:2] == [f"0 {chain // 2} 0"] * 2
        assert watch.worst < HELD, f"one loop callback held the loop {watch.worst:.2f} s"
        assert answered > 0  # served throughout, each call by its deadline
        # The whole chain cached, on one path (the second half on the first's), and
        # nothing left with the closed session.
        stats = srv.run(lambda: (engine.cache.total_size(), engine.allocator.num_allocated()))
        assert stats == (chain, chain)
        channel, stub = stub_for(srv.address)
        with channel:
            reply = stub.Stats(pb.StatsRequest(model="m")).models[0]
            assert (reply.locks, reply.session_slots) == (0, 0)
        hashes = path.read_bytes()
        first, last = hashes[:32].hex(), hashes[-32:].hex()
        index = engine.page_index
        hidden = srv.run(lambda: HashPages(engine)._locate(("a", 1), last))
        assert srv.run(lambda: index.path(hidden, last)[1]) == chain
        assert srv.run(lambda: index.find(hidden, first).parent) is None
        srv.check_integrity()
    finally:
        srv.stop()

"""ExistsPages under a flood, and its refusals (issue 21, item 11).

Eight parallel ExistsPages of 1M hashes each once stalled every other client for 4.6 s:
one call decoded and looked up all of its hashes in one loop turn. Now it works in
slices (page_rpcs.SLICE) with the loop free between them, a call names at most a
1M-token prompt's pages, and where tenants or quotas are configured it needs a session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from harness import pb, running, stub_for

from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.rpc.page_rpcs import MAX_PROMPT_TOKENS

POOL = PoolConfig(size=256, layers=1, k_heads=1, k_head_dim=4)
CODE = grpc.StatusCode


# One flooding client: its own process, so that its 32 MiB requests are not serialized
# on this process's GIL, which the in-process server and the victim share.
FLOOD = """
import os, sys, grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc
stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel(sys.argv[1]))
request = pb.ExistsPagesRequest(model="m", page_hashes=os.urandom(32 * int(sys.argv[2])))
for _ in range(3):  # again and again, so that the flooders' calls overlap
    answer = len(stub.ExistsPages(request, timeout=300).present)
print(answer)
"""


def test_a_flood_of_large_lookups_leaves_other_clients_served(tmp_path) -> None:
    # Page size 4: a 1M-token prompt's 2^18 pages, 8 MiB of hashes, per call.
    models = (ModelConfig(name="m", page_size=4, pool=POOL),)
    pages = MAX_PROMPT_TOKENS // 4
    with running(tmp_path, models, max_request_tokens=MAX_PROMPT_TOKENS) as srv:
        channel, stub = stub_for(srv.address)
        flooders = [subprocess.Popen([sys.executable, "-c", FLOOD, srv.address, str(pages)],
                                     stdout=subprocess.PIPE, text=True) for _ in range(8)]
        worst = 0.0
        with channel:
            served = 0
            while any(p.poll() is None for p in flooders):
                start = time.perf_counter()
                stub.Stats(pb.StatsRequest(model="m"), timeout=60)
                worst = max(worst, time.perf_counter() - start)
                served += 1
                time.sleep(0.02)
        answers = [int(p.communicate()[0]) for p in flooders]
        assert answers == [pages] * 8 and served > 10
        assert worst < 1.0, f"a Stats call waited {worst:.2f} s behind the flood"


def test_refusals_and_the_session_rule(tmp_path) -> None:
    models = (ModelConfig(name="g", page_size=16, pool=POOL),)
    with running(tmp_path, models, max_request_tokens=4 * MAX_PROMPT_TOKENS,
                 max_session_slots=64) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            before = stub.Stats(pb.StatsRequest(model="g")).models[0]
            request = pb.ExistsPagesRequest(model="g", page_hashes=b"\1" * 32 * 4)
            with pytest.raises(grpc.RpcError) as err:  # quotas on: a session is needed
                stub.ExistsPages(request)
            assert err.value.code() == CODE.FAILED_PRECONDITION
            assert "session_id" in err.value.details()
            request.session_id = stub.OpenSession(pb.OpenSessionRequest()).session_id
            assert stub.ExistsPages(request).present == b"\0" * 4
            # A 1M-token prompt's pages at page size 16, and one more.
            pages = MAX_PROMPT_TOKENS // 16
            request.page_hashes = os.urandom(32 * pages)
            assert len(stub.ExistsPages(request).present) == pages
            request.page_hashes += b"\2" * 32
            with pytest.raises(grpc.RpcError) as err:
                stub.ExistsPages(request)
            assert err.value.code() == CODE.RESOURCE_EXHAUSTED
            request.page_hashes = b"\3" * 33
            with pytest.raises(grpc.RpcError) as err:
                stub.ExistsPages(request)
            assert err.value.code() == CODE.INVALID_ARGUMENT
            after = stub.Stats(pb.StatsRequest(model="g")).models[0]
            assert (after.evictable_tokens, after.locks, after.session_slots) == \
                (before.evictable_tokens, before.locks, before.session_slots)
            srv.check_integrity()
    # No tenants and no quotas: no session needed (as before).
    with running(tmp_path, models) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            request = pb.ExistsPagesRequest(model="g", page_hashes=b"\1" * 32)
            assert stub.ExistsPages(request).present == b"\0"

"""The slot quarantine (engine/slots.py): slots an outside writer may still fill are
held by no session and handed out by nothing, a Reset included, until released."""

from __future__ import annotations

import pytest

from prefixcache.cache import RadixKey
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.errors import PreconditionError
from prefixcache.server.service import CacheService

PAGE = 4
SIZE = 64


def _service() -> CacheService:
    return CacheService(
        [ModelConfig(name="m", page_size=PAGE, pool=PoolConfig(size=SIZE, k_heads=1, k_head_dim=2))]
    )


@pytest.mark.parametrize("back_to_session", [False, True])
def test_a_reset_frees_every_slot_but_the_quarantined(back_to_session: bool) -> None:
    svc = _service()
    engine = svc.engine("m")
    writer, other = svc.open_session(10.0), svc.open_session(10.0)
    engine.alloc(other, 8)  # before: freed by the Reset
    fetching, _ = engine.alloc(writer, 12)  # three pages, the last one whole
    engine.quarantine(writer, fetching)
    tree, _ = engine.alloc(other, 8)
    engine.insert(RadixKey(list(range(1, 9))), tree, other)
    svc.check_integrity()
    with pytest.raises(PreconditionError):  # no longer the session's to free
        engine.free(writer, fetching)
    svc.reset("m")
    svc.check_integrity()
    assert engine.quarantined == 12
    assert engine.allocator.available_size() == SIZE - 12
    # Everything the pool hands out now lies outside the quarantine.
    third = svc.open_session(10.0)
    given, _ = engine.alloc(third, SIZE - 12)
    assert not set(given.tolist()) & set(fetching.tolist())
    svc.check_integrity()
    engine.free(third, given)
    engine.unquarantine(fetching, writer if back_to_session else None)
    svc.check_integrity()
    assert engine.quarantined == 0
    if back_to_session:
        assert writer.slots["m"] == 12
        engine.insert(RadixKey(list(range(100, 112))), fetching, writer)
        assert engine.allocator.available_size() == SIZE - 12
    else:
        assert engine.allocator.available_size() == SIZE
    svc.check_integrity()
    with pytest.raises(PreconditionError):  # out of the quarantine already
        engine.unquarantine(fetching)


def test_the_integrity_check_sees_a_quarantine_out_of_step() -> None:
    svc = _service()
    engine = svc.engine("m")
    session = svc.open_session(10.0)
    slots, _ = engine.alloc(session, 4)
    engine.quarantine(session, slots)
    svc.check_integrity()
    engine.quarantined += 1  # a count that disagrees with the marks
    with pytest.raises(Exception, match="quarantined"):
        svc.check_integrity()

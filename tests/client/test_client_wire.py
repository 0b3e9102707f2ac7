"""Packing token ids and slots without numpy or torch, and the import-time promise."""

from __future__ import annotations

import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixcache.client import InvalidArgument, MatchReply
from prefixcache.client._wire import as_numpy, as_tensor, pack_slots, pack_tokens, unpack_slots

REPO = Path(__file__).resolve().parents[2]


def test_every_input_packs_to_the_same_bytes() -> None:
    want = np.array([1, 2, 70000], dtype="<u4").tobytes()
    for given in (
        [1, 2, 70000],
        (1, 2, 70000),
        array("I", [1, 2, 70000]),
        array("q", [1, 2, 70000]),
        np.array([1, 2, 70000], dtype=np.int64),
        torch.tensor([1, 2, 70000]),
        torch.tensor([1, 2, 70000], dtype=torch.int32),
        iter([1, 2, 70000]),
        want,
    ):
        assert pack_tokens(given) == (want, 1), type(given)
    pairs = np.array([1, 2, 3, 4], dtype="<u4").tobytes()
    for given in (
        [(1, 2), (3, 4)],
        [[1, 2], [3, 4]],
        np.array([[1, 2], [3, 4]]),
        torch.tensor([[1, 2], [3, 4]]),
    ):
        assert pack_tokens(given) == (pairs, 2), type(given)
    assert pack_tokens([1, 2, 3, 4], token_width=2) == (pairs, 2)
    assert pack_tokens([]) == (b"", 1)
    with pytest.raises(InvalidArgument):
        pack_tokens([1, 2, 3], token_width=2)
    slots = np.array([5, -1, 2**40], dtype="<i8").tobytes()
    for given in (
        [5, -1, 2**40],
        array("q", [5, -1, 2**40]),
        np.array([5, -1, 2**40]),
        torch.tensor([5, -1, 2**40]),
        slots,
    ):
        assert pack_slots(given) == slots, type(given)
    assert pack_slots(None) == b"" and pack_slots(3) == pack_slots([3])
    assert pack_slots(torch.tensor([[1, 2], [3, 4]])) == pack_slots([1, 2, 3, 4])
    for bad in ([1.0], np.array([1.5]), torch.tensor([1.5]), [2**63], object()):
        with pytest.raises(InvalidArgument):
            pack_slots(bad)


def test_unpacked_slots_view_as_numpy_and_torch() -> None:
    slots = unpack_slots(pack_slots([7, 8, 9]))
    assert slots == array("q", [7, 8, 9])
    assert as_numpy(slots).tolist() == [7, 8, 9] and as_numpy(array("q")).size == 0
    tensor = as_tensor(slots)
    assert tensor.dtype == torch.int64 and tensor.tolist() == [7, 8, 9]
    assert as_tensor(array("q")).shape == (0,)
    reply = MatchReply(2, slots[:2], allocated=slots[2:])
    assert reply.all_slots() == slots and reply.slots_tensor().tolist() == [7, 8]
    with pytest.raises(InvalidArgument):
        unpack_slots(b"\x00" * 7)


def test_the_client_works_without_numpy_or_torch() -> None:
    """The base install has neither: packing falls back to ``array``."""
    code = (
        "import sys\n"
        "sys.modules['numpy'] = None\n"
        "sys.modules['torch'] = None\n"
        "import prefixcache.client as c\n"
        "from prefixcache.client._wire import pack_tokens, pack_slots, unpack_slots\n"
        "assert pack_tokens([1, 2])[0] == b'\\x01\\0\\0\\0\\x02\\0\\0\\0'\n"
        "assert list(unpack_slots(pack_slots(range(3)))) == [0, 1, 2]\n"
        "client = c.PrefixCacheClient('/nonexistent.sock', retries=0, fail_open=True)\n"
        "assert client.match('m', [1, 2]).skipped\n"
        "client.close()\n"
    )
    env = {"PYTHONPATH": f"{REPO / 'client'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr

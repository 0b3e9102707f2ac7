"""The client's packing from every integer container: the same bytes as the list path and
the same refusals, with numpy and without it."""

from __future__ import annotations

import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.client import InvalidArgument
from prefixcache.client._wire import pack_slots, pack_tokens

REPO = Path(__file__).resolve().parents[2]
U32 = 2**32
_EDGES = [0, 1, 127, 128, 2**16 - 1, 2**16, 2**31 - 1, 2**31, U32 - 1]
valid_ids = st.lists(st.one_of(st.sampled_from(_EDGES), st.integers(0, U32 - 1)), max_size=40)


def token_containers(ids: list[int]) -> list[Any]:
    out: list[Any] = [
        tuple(ids),
        array("I", ids),
        array("q", ids),
        array("L", ids),
        array("Q", ids),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint32),
        np.array(ids, dtype=">i8"),
        torch.tensor(ids, dtype=torch.int64),
    ]
    if all(i < 2**31 for i in ids):
        out += [
            array("i", ids),
            np.array(ids, dtype=np.int32),
            torch.tensor(ids, dtype=torch.int32),
        ]
    if all(i < 2**16 for i in ids):
        out += [array("H", ids), np.array(ids, dtype=np.uint16)]
    return out


@settings(max_examples=60, deadline=None)
@given(valid_ids)
def test_every_container_packs_tokens_like_the_list(ids: list[int]) -> None:
    want = pack_tokens(ids)
    for given_ids in token_containers(ids):
        assert pack_tokens(given_ids) == want, type(given_ids)


@settings(max_examples=60, deadline=None)
@given(valid_ids, st.sampled_from([-1, -(2**31), U32, 2**40, 2**63 - 1]), st.integers(0, 40))
def test_out_of_range_tokens_are_refused_alike(ids: list[int], bad: int, where: int) -> None:
    ids = [*ids[:where], bad, *ids[where:]]
    holders: list[Any] = [
        ids,
        array("q", ids),
        np.array(ids, dtype=np.int64),
        torch.tensor(ids, dtype=torch.int64),
    ]
    if bad >= 0:
        holders += [array("Q", ids), np.array(ids, dtype=np.uint64)]
    if all(-(2**31) <= i < 2**31 for i in ids):
        holders += [array("i", ids), np.array(ids, dtype=np.int32)]
    for holder in holders:
        with pytest.raises(InvalidArgument):
            pack_tokens(holder)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30))
def test_every_container_packs_slots_like_the_list(slots: list[int]) -> None:
    want = pack_slots(slots)
    holders: list[Any] = [
        array("q", slots),
        array("l", slots),
        np.array(slots, dtype=np.int64),
        torch.tensor(slots, dtype=torch.int64),
    ]
    if all(s >= 0 for s in slots):
        holders += [array("Q", slots), np.array(slots, dtype=np.uint64)]
    if all(-(2**31) <= s < 2**31 for s in slots):
        holders += [array("i", slots), np.array(slots, dtype=np.int32)]
    for holder in holders:
        assert pack_slots(holder) == want, type(holder)
    with pytest.raises(InvalidArgument):
        pack_slots(array("Q", [2**63]))
    with pytest.raises(InvalidArgument):
        pack_slots(np.array([2**63], dtype=np.uint64))


@pytest.mark.parametrize(
    "bad",
    [
        [1.5],
        array("d", [1.0]),
        np.array([1.0]),
        torch.tensor([1.0]),
        np.array([True]),
        torch.tensor([True]),
        np.zeros((2, 2, 2), dtype=np.int64),
        "12",
    ],
)
def test_non_integer_tokens_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgument):
        pack_tokens(bad)


def test_arrays_pack_without_numpy() -> None:
    """Without numpy, an array('q') still packs (the array constructor's C loop) and is
    refused out of range exactly as with it."""
    code = (
        "import sys\n"
        "sys.modules['numpy'] = None\n"
        "sys.modules['torch'] = None\n"
        "from array import array\n"
        "from prefixcache.client import InvalidArgument\n"
        "from prefixcache.client._wire import pack_slots, pack_tokens\n"
        "ids = [0, 1, 2**31, 2**32 - 1]\n"
        "for given in (array('q', ids), array('L', ids), array('Q', ids)):\n"
        "    assert pack_tokens(given) == pack_tokens(ids), given\n"
        "assert pack_tokens(array('H', [1, 2])) == pack_tokens([1, 2])\n"
        "assert pack_slots(array('i', [-5, 7])) == pack_slots([-5, 7])\n"
        "for bad in ([-1], [2**32]):\n"
        "    try:\n"
        "        pack_tokens(array('q', bad))\n"
        "    except InvalidArgument:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{bad} was packed')\n"
    )
    env = {"PYTHONPATH": f"{REPO / 'client'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr

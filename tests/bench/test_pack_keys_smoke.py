"""Smoke test of bench/pack_keys.py: every container packs to the list's bytes through the
client and the server, and the table comes out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from bench.pack_keys import main  # noqa: E402


def test_pack_keys_bench_prints_a_row_per_container(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--tokens", "300", "--tokens", "1", "--budget-ms", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| input | tokens | copy µs | client µs")
    assert len(lines) == 2 + 2 * 8
    assert all(line.count("|") == 8 for line in lines)

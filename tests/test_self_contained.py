"""The repository needs nothing beside its checkout: no file reads or points to a
folder next to the repository (a clean clone in CI has none)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A path that leaves the checkout for a sibling folder (two dots, a slash and one of
# these names), or Python that climbs above the repository root and names a folder.
SIBLINGS = ("shared", "traces", "research", "spec")
OUTSIDE = re.compile(
    r"\.\./(" + "|".join(SIBLINGS) + r")\b"
    r"|(REPO|ROOT|_REPO|REPO_ROOT)\.parent\s*/"
    r"|parents\[\d\]\.parent\s*/"
)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    suffixes = {".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".sh", ""}
    return [
        REPO / n
        for n in names
        if Path(n).suffix in suffixes and not n.startswith("bench/traces/") and (REPO / n).is_file()
    ]


def test_no_file_reaches_outside_the_checkout() -> None:
    offenders = []
    for path in tracked_text_files():
        if path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_traces_the_bench_replays_are_in_the_repository() -> None:
    traces = REPO / "bench" / "traces"
    for name in ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"):
        first = (traces / name).read_text().splitlines()[0]
        assert '"hash_ids"' in first and '"input_length"' in first
    assert "Apache-2.0" in (traces / "README.md").read_text()

"""Run mypy and hold its errors to mypy-baseline.txt, which may only shrink.

``prefixcache.cache`` and ``prefixcache.client`` are checked strictly (pyproject.toml,
``[tool.mypy]``); the rest of the tree is checked too, and its known errors are listed
in the baseline. A run fails when a file has more errors of one code than the baseline
lists for it (a new error), and also when it has fewer (the baseline must follow, so a
fixed error cannot come back unnoticed): ``--update`` then rewrites the baseline, and
refuses to where that would let any count grow.

Errors are compared as counts per (file, error code), without line numbers, so moving
code does not disturb the baseline; the messages are kept in it for the reader.

Usage: python scripts/check_types.py [--update] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "mypy-baseline.txt"
HEADER = (
    "# mypy's known errors, one a line (file: error: message  [code]).\n"
    "# It may only shrink: scripts/check_types.py.\n"
)
_ERROR = re.compile(
    r"^(?P<path>[^:\s]+\.pyi?):\d+(?::\d+)?: error: (?P<message>.*?)"
    r"  \[(?P<code>[a-z0-9-]+)\]$"
)


def errors_of(output: str) -> list[str]:
    """mypy's error lines, as ``path: error: message  [code]`` (no line numbers),
    sorted. Notes and the summary line are left out."""
    found = []
    for line in output.splitlines():
        match = _ERROR.match(line.strip())
        if match:
            found.append(f"{match['path']}: error: {match['message']}  [{match['code']}]")
    return sorted(found)


def counts(entries: Iterable[str]) -> Counter[tuple[str, str]]:
    """How many errors of each code each file has."""
    out: Counter[tuple[str, str]] = Counter()
    for entry in entries:
        path = entry.split(": error: ", 1)[0]
        code = entry.rsplit("[", 1)[-1].rstrip("]")
        out[path, code] += 1
    return out


def compare(current: list[str], baseline: list[str]) -> tuple[list[str], list[str]]:
    """(new, fixed): per file and code, errors beyond the baseline's count, and
    baseline entries no error stands for any more, each as ``path [code] (+n)``."""
    now, known = counts(current), counts(baseline)
    new = [
        f"{path} [{code}] (+{now[path, code] - known[path, code]})"
        for path, code in sorted(now)
        if now[path, code] > known[path, code]
    ]
    fixed = [
        f"{path} [{code}] (-{known[path, code] - now[path, code]})"
        for path, code in sorted(known)
        if known[path, code] > now[path, code]
    ]
    return new, fixed


def read_baseline(path: Path = BASELINE) -> list[str]:
    if not path.exists():
        return []
    return sorted(
        line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    )


def run_mypy(cache_dir: str | None) -> str:
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--no-error-summary",
        "--show-error-codes",
        "--no-pretty",
        "--hide-error-context",
    ]
    if cache_dir:
        command += ["--cache-dir", cache_dir]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"mypy failed to run (exit {result.returncode})")
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--update",
        action="store_true",
        help="rewrite the baseline to the current errors (it may not grow)",
    )
    parser.add_argument("--cache-dir", help="mypy's cache directory")
    args = parser.parse_args(argv)
    current = errors_of(run_mypy(args.cache_dir))
    new, fixed = compare(current, read_baseline())
    if new:
        print(
            "mypy finds errors the baseline does not list (fix them; the baseline "
            "may only shrink):\n  " + "\n  ".join(new)
        )
        return 1
    if fixed and not args.update:
        print(
            "errors the baseline lists are fixed: run python scripts/check_types.py "
            "--update to shrink it:\n  " + "\n  ".join(fixed)
        )
        return 1
    if args.update:
        BASELINE.write_text(HEADER + "".join(f"{entry}\n" for entry in current))
        print(f"mypy-baseline.txt: {len(current)} errors")
    else:
        print(f"mypy: no errors beyond the baseline ({len(current)} known)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Generate the `prefixcache.v1` package (client/prefixcache/v1/) from protos/.

Usage: python scripts/gen_protos.py

The wheel and editable builds call `generate()` from hatch_build.py, so both
paths produce the same files. Output is never edited by hand and never committed.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path("prefixcache", "v1")

_INIT = '"""Generated from protos/prefixcache/v1 by scripts/gen_protos.py. Do not edit."""\n'


def generate(root: Path = ROOT) -> list[Path]:
    """Regenerate `<root>/client/prefixcache/v1` from `<root>/protos/prefixcache/v1`.

    Returns the generated files. Raises RuntimeError if protoc reports an error.
    """
    # Imported here so that hatch can load this module before checking its deps.
    from grpc_tools import protoc

    proto_root, out_root = root / "protos", root / "client"
    protos = sorted(str(p) for p in (proto_root / PACKAGE).glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root / PACKAGE}")

    # The whole directory is generated, so start clean: a deleted .proto must
    # not leave a stale module behind.
    out_dir = out_root / PACKAGE
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)

    well_known = resources.files("grpc_tools") / "_proto"
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"--proto_path={proto_root}",
            f"--proto_path={well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            *protos,
        ]
    )
    if status != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with status {status}")
    (out_dir / "__init__.py").write_text(_INIT)
    (out_dir / "py.typed").write_text("")
    return sorted(out_dir.iterdir())


def main() -> int:
    for path in generate():
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hatch build hook: generate `prefixcache.v1` from protos/ before every wheel build.

Runs for regular and editable wheels alike. The generator itself lives in
scripts/gen_protos.py so that the build and the manual command cannot drift.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ProtoCodegenHook(BuildHookInterface):
    """Writes client/prefixcache/v1/*_pb2*.py(i); pyproject lists them as artifacts."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        script = Path(self.root, "scripts", "gen_protos.py")
        spec = importlib.util.spec_from_file_location("_prefixcache_gen_protos", script)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot load {script}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        generated = module.generate(Path(self.root))
        self.app.display_info(f"generated {len(generated)} files from protos/")

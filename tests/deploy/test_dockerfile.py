"""The Dockerfile installs and starts prefixcache the way CI and the README do.

No Docker engine is available here, so the image is never built in CI: these tests read
the Dockerfile and compare its install and start commands with the ones CI runs
(.ci/run), the README shows and the Kubernetes manifests use, and lint it with hadolint.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib

from deploy.support import (
    CHART,
    DOCKERFILE,
    REPO,
    dockerfile_instructions,
    docs_of,
    exec_form,
    healthcheck_command,
    pod_spec,
    sidecar,
    stages,
    tool,
)

from prefixcache.server.config import ServerConfig

CI_RUN = (REPO / ".ci" / "run").read_text()
README = (REPO / "README.md").read_text()


def _ci_command(name: str) -> str:
    match = re.search(rf'^{name}="(.*)"$', CI_RUN, re.MULTILINE)
    assert match, f".ci/run no longer defines {name}"
    return match[1]


def _args(stage: list[tuple[str, str]]) -> dict[str, str]:
    """The stage's ARG defaults."""
    out = {}
    for instruction, rest in stage:
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            out[name] = default
    return out


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for instruction, rest in stage:
        if instruction == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                out[name] = value
    return out


def _expand(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m[1]], value)


def _runs(stage: list[tuple[str, str]]) -> list[str]:
    return [rest for instruction, rest in stage if instruction == "RUN"]


def test_two_stages_build_the_wheel_then_a_slim_runtime() -> None:
    build, runtime = stages()
    assert build[0] == ("FROM", "python:3.11-slim AS build")
    assert runtime[0][1].split()[0] == "python:3.11-slim"
    assert any("python -m build --wheel --outdir /dist" in run for run in _runs(build))
    assert ("COPY", "--from=build /dist/ /tmp/dist/") in runtime
    # Nothing of the source tree reaches the runtime image but the wheel.
    assert all(i != "COPY" or rest.startswith("--from=build") for i, rest in runtime)


def test_build_stage_copies_everything_the_wheel_is_built_from() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {
        "pyproject.toml",
        project["project"]["readme"],
        wheel["hooks"]["custom"]["path"],
        # The hook runs scripts/gen_protos.py over protos/.
        "scripts",
        "protos",
    }
    needed |= {package.split("/")[0] for package in wheel["packages"]}
    copied = set()
    build = stages()[0]
    for instruction, rest in build:
        if instruction == "COPY":
            *sources, _dest = rest.split()
            copied |= {s.rstrip("/") for s in sources}
    assert needed <= copied, f"not copied into the build stage: {needed - copied}"
    for source in copied:
        assert (REPO / source).exists(), source


def test_torch_is_the_one_ci_and_the_readme_pin_and_installs_first() -> None:
    runtime = stages()[1]
    args = _args(runtime)
    torch_cmd = _ci_command("TORCH_CMD")
    pin = re.fullmatch(r"pip install torch==(\S+)", torch_cmd)
    assert pin, torch_cmd
    assert args["TORCH_VERSION"] == pin[1]
    assert f"pip install torch=={pin[1]} && pip install '.[server]' && prefixcache serve" in README
    # The default flavour is the CPU index, the same build CI installs from PyPI.
    assert args["TORCH_FLAVOUR"] == "cpu"
    assert _expand(args["TORCH_INDEX_URL"], args) == "https://download.pytorch.org/whl/cpu"
    runs = _runs(runtime)
    torch_runs = [i for i, run in enumerate(runs) if '"torch==$TORCH_VERSION"' in run]
    wheel_runs = [i for i, run in enumerate(runs) if "/tmp/dist/prefixcache-" in run]
    assert len(torch_runs) == 1 and len(wheel_runs) == 1
    assert torch_runs[0] < wheel_runs[0], "torch must be installed before the wheel"
    assert (
        runs[torch_runs[0]] == 'pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"'
    )


def test_wheel_is_installed_with_the_extras_ci_installs_less_dev() -> None:
    install = _ci_command("INSTALL_CMD")
    match = re.fullmatch(r"pip install -e '\.\[([\w,]+)\]'", install)
    assert match, install
    ci_extras = set(match[1].split(",")) - {"dev"}
    (run,) = [r for r in _runs(stages()[1]) if "/tmp/dist/prefixcache-" in r]
    extras = re.search(r'pip install "\$\{wheel\}\[([\w,]+)\]"', run)
    assert extras, run
    assert set(extras[1].split(",")) == ci_extras == {"server", "tier"}


def test_starts_prefixcache_serve_like_the_readme_and_the_pod() -> None:
    (cmd,) = [rest for i, rest in stages()[1] if i == "CMD"]
    assert exec_form(cmd) == ["prefixcache", "serve"]
    assert " && prefixcache serve\n" in README
    for files in (("deployment.yaml",), ("gpu/deployment.yaml",)):
        assert sidecar(docs_of(*files))["command"] == exec_form(cmd)


def test_runs_as_the_numeric_non_root_user_the_pod_expects() -> None:
    runtime = stages()[1]
    (user,) = [rest for i, rest in runtime if i == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) != 0, user
    security = pod_spec(docs_of("deployment.yaml"))["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid))
    assert security["runAsNonRoot"] is True
    values = (CHART / "values.yaml").read_text()
    assert f"runAsUser: {uid}\n" in values and f"runAsGroup: {gid}\n" in values
    # The socket directory the image's PREFIXCACHE_LISTEN points into is the user's.
    listen = _env(runtime)["PREFIXCACHE_LISTEN"]
    directory = listen.removeprefix("unix:").rpartition("/")[0]
    assert directory == "/run/prefixcache"
    assert any(f"chown {uid}:{gid} {directory}" in run for run in _runs(runtime))


def test_exposes_the_metrics_port() -> None:
    (port,) = [rest for i, rest in stages()[1] if i == "EXPOSE"]
    assert int(port) == ServerConfig().metrics_port
    ports = sidecar(docs_of("deployment.yaml"))["ports"]
    assert [p["containerPort"] for p in ports if p["name"] == "metrics"] == [int(port)]


def test_healthcheck_is_the_kubernetes_probe() -> None:
    command = healthcheck_command()
    assert command == ["prefixcache", "health"]
    (args,) = [rest for i, rest in dockerfile_instructions() if i == "HEALTHCHECK"]
    assert "--start-period=" in args and "--timeout=" in args
    for files in (("deployment.yaml",), ("gpu/deployment.yaml",)):
        container = sidecar(docs_of(*files))
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == command, probe
        assert container["readinessProbe"]["exec"]["command"] == [
            *command,
            "--service",
            "prefixcache.v1.PrefixCache",
        ]


def test_hadolint_finds_nothing() -> None:
    hadolint = tool("hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "", result.stdout

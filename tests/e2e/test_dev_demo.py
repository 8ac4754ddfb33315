"""The README's demo: ``conveyor dev`` as a new user runs it, on free loopback ports.

It starts the embedded tansu broker, its own Spark Connect server (on a free port), the
demo producer and ``dagster dev``; the ``conveyor_scheduler`` sensor launches the demo
connector by itself; orders land in JSONL files; the UI shows the demo's lineage and its plotted
metadata (headless Chromium; screenshots go to docs/img with
CONVEYOR_UPDATE_SCREENSHOTS=1); Ctrl-C (SIGINT) stops every process it started,
connector run and Spark server included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.core.model import ConnectorStatus
from conveyor.core.ports import free_port, port_open
from conveyor.core.processes import pid_alive
from conveyor.store.meta import MetaStore, UnknownConnectorError
from tests.e2e.conftest import SETTLE_S, wait_for
from tests.e2e.test_ui_screenshot import CHROMIUM, PLOTTED, Chromium, has_tooltips, img_dir

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

DEMO = "demo_orders"


class Dev:
    def __init__(self, cwd: Path, proc: subprocess.Popen[bytes], ports: dict[str, int]):
        self.cwd, self.proc, self.ports = cwd, proc, ports
        self.home = cwd / ".conveyor"
        self.store = MetaStore(f"sqlite:///{self.home / 'meta.db'}")
        # A wide, fixed terminal for the CLI's tables.
        self.env = {**os.environ, "CONVEYOR_HOME": str(self.home), "COLUMNS": "200"}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        exe = str(Path(sys.executable).parent / "conveyor")
        return subprocess.run(
            [exe, *args], env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=60
        )

    def log(self) -> str:
        return (self.cwd / "conveyor-dev.log").read_text(errors="replace")[-4000:]

    def lines(self) -> int:
        out = self.home / "out" / "orders"
        return (
            sum(len(f.read_text().splitlines()) for f in out.glob("*.jsonl")) if out.exists() else 0
        )


@pytest.fixture(scope="module")
def dev() -> Iterator[Dev]:
    cwd = Path(tempfile.mkdtemp(prefix="conveyor-dev-"))
    ports = {"kafka": free_port(), "ui": free_port(), "spark": free_port(), "api": free_port()}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CONVEYOR_", "DAGSTER_HOME")) or k == "CONVEYOR_TEST_PG_URL"
    }
    exe = str(Path(sys.executable).parent / "conveyor")
    log = open(cwd / "conveyor-dev.log", "wb")  # noqa: SIM115
    # The README's second command, on free ports, from a fresh directory.
    proc = subprocess.Popen(
        [exe, "dev", "--kafka-port", str(ports["kafka"]), "--port", str(ports["ui"])]
        + ["--spark-port", str(ports["spark"]), "--api-port", str(ports["api"]), "--rate", "200"],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    dev = Dev(cwd, proc, ports)
    try:
        wait_for(
            lambda: port_open("127.0.0.1", ports["ui"]) or proc.poll() is not None,
            240,
            "the Dagster UI",
        )
        assert proc.poll() is None, dev.log()
        yield dev
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def graphql(dev: Dev, query: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{dev.ports['ui']}/graphql",
        json.dumps({"query": query}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_the_scheduler_runs_the_demo_connector_and_orders_reach_the_files(dev: Dev) -> None:
    # Nobody launches anything: the scheduler sensor assigns the demo to broker `local`.
    def demo_running() -> bool:
        try:
            r = dev.store.get(DEMO)
        except UnknownConnectorError:
            return False  # the scheduler's first tick has not synced the spec file yet
        return r.status == ConnectorStatus.RUNNING and bool(r.heartbeat_at)

    wait_for(demo_running, 180, f"{DEMO} Running\n{dev.log()}")
    row = dev.store.get(DEMO)
    assert row.broker_id == "local" and row.run_id
    # Through conveyor dev's own Spark Connect server.
    full_log = (dev.cwd / "conveyor-dev.log").read_text(errors="replace")
    assert f"Spark Connect ready at sc://127.0.0.1:{dev.ports['spark']}" in full_log, dev.log()
    wait_for(lambda: dev.lines() >= 200, SETTLE_S, "demo orders in .conveyor/out/orders")
    wait_for(
        lambda: sum(dev.store.committed_offsets(DEMO).values()) > 0, SETTLE_S, "offsets committed"
    )
    # The CLI shows it, as the README says, and so does the REST API.
    r = dev.cli("connector", "list")
    assert r.returncode == 0 and DEMO in r.stdout and "Running" in r.stdout, r.stdout + r.stderr
    token = (dev.home / "api-token").read_text().strip()
    req = urllib.request.Request(
        f"http://127.0.0.1:{dev.ports['api']}/connectors/{DEMO}/status",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        status = json.loads(resp.read())
    assert status["connector"]["state"] == "RUNNING" and status["tasks"][0]["worker_id"] == "local"
    # The lineage is in the code location: topic -> files -> dead letters.
    keys = {
        "/".join(n["assetKey"]["path"])
        for n in graphql(dev, "{ assetNodes { assetKey { path } } }")["data"]["assetNodes"]
    }
    assert {"kafka/orders", f"dead_letters/{DEMO}"} <= keys
    assert any(k.startswith("localfile/") for k in keys), keys


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_the_ui_shows_the_demo_lineage_and_its_plots(dev: Dev, tmp_path: Path) -> None:
    # Two materializations to plot: the run's first progress event and its final one
    # (a stop from the CLI); then the demo is started again for the Ctrl-C test.
    wait_for(lambda: dev.store.get(DEMO).counters.get("messages_out", 0) > 0, SETTLE_S, "progress")
    assert dev.cli("connector", "stop", DEMO).returncode == 0
    wait_for(
        lambda: dev.store.get(DEMO).status == ConnectorStatus.STOPPED, SETTLE_S, "demo stopped"
    )
    assert dev.cli("connector", "start", DEMO).returncode == 0
    sink_key = next(
        n["assetKey"]["path"]
        for n in graphql(dev, "{ assetNodes { assetKey { path } } }")["data"]["assetNodes"]
        if n["assetKey"]["path"][0] == "localfile"
    )
    assert graphql(dev, "mutation { setNuxSeen }")["data"]["setNuxSeen"] is True
    base = f"http://127.0.0.1:{dev.ports['ui']}"
    browser = Chromium(CHROMIUM, Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)))
    try:
        # `dagster dev -m conveyor.dagster.definitions` names the code location after the module.
        browser.goto(
            f"{base}/locations/__repository__@conveyor.dagster.definitions/asset-groups/connector_{DEMO}"
        )
        browser.wait_js(
            has_tooltips("orders", sink_key[-1], DEMO), SETTLE_S, "the demo's asset nodes"
        )
        browser.wait_js(
            "!document.body.innerText.includes('Loading')", SETTLE_S, "node details loaded"
        )
        time.sleep(1)  # layout animation
        graph = img_dir(tmp_path) / "demo-asset-graph.png"
        browser.screenshot(graph)
        assert graph.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        text = browser.js("document.body.innerText")
        for kind in ("Kafka", "File", "Parquet"):
            assert kind in text, kind

        browser.goto(f"{base}/assets/{'/'.join(sink_key)}")
        plots = "Array.from(document.querySelectorAll('button')).find(b => b.textContent.trim() === 'Plots')"
        browser.wait_js(f"!!{plots}", SETTLE_S, "the metadata Plots toggle")
        browser.js(f"{plots}.scrollIntoView({{block: 'start'}}); {plots}.click()")
        browser.wait_js(
            f"document.querySelectorAll('canvas').length >= {len(PLOTTED)}", SETTLE_S, "the plots"
        )
        time.sleep(1.5)  # chart animations
        shot = img_dir(tmp_path) / "demo-asset-plots.png"
        browser.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        browser.close()
    wait_for(
        lambda: dev.store.get(DEMO).status == ConnectorStatus.RUNNING, 120, "demo Running again"
    )


def test_ctrl_c_stops_every_process_it_started(dev: Dev) -> None:
    run_pid = dev.store.get(DEMO).run_pid
    assert run_pid and pid_alive(run_pid)
    # The Spark server runs in a session of its own: find its JVM by its port.
    jvm = subprocess.run(
        ["pgrep", "-f", f"spark.connect.grpc.binding.port={dev.ports['spark']}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert jvm, "conveyor dev's Spark Connect server is not running"
    dev.proc.send_signal(signal.SIGINT)
    assert dev.proc.wait(90) == 0, dev.log()
    assert "all processes stopped" in dev.log()
    # Nothing is orphaned: the connector run, the broker and the UI are gone.
    wait_for(lambda: not pid_alive(run_pid), SETTLE_S, "the connector run process gone")
    wait_for(
        lambda: not any(pid_alive(int(p)) for p in jvm), SETTLE_S, "the Spark server's JVM gone"
    )
    for name, port in dev.ports.items():
        assert not port_open("127.0.0.1", port), f"{name} still listening on {port}"

    def session_left() -> str:
        r = subprocess.run(["pgrep", "-a", "-s", str(dev.proc.pid)], capture_output=True, text=True)
        return r.stdout.strip()

    # Servers finish exiting shortly after their stop (the Spark JVM, dagster's code servers).
    wait_for(lambda: session_left() == "", SETTLE_S, "every process of conveyor dev's session gone")
    # The demo connector was stopped by the shutdown, and stays meant to run next time.
    row = dev.store.get(DEMO)
    assert row.desired.value == "running" and row.status != ConnectorStatus.RUNNING, row

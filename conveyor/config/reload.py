"""Reloading the Dagster code location when the connector specs change.

A connector's job ``connector__<name>`` must exist in the code location before a
run of it can be launched, so a new spec file (written by hand, by the REST API or
by ``conveyor connector apply``) needs a reload of the location. The scheduler
sensor notices that the files differ from what its location was built from and
asks the Dagster webserver for a reload over GraphQL (``reloadRepositoryLocation``,
what the UI's "Reload" button does); the REST API asks right after it wrote a file.

The webserver is found at ``$CONVEYOR_DAGSTER_URL`` (``conveyor dev`` sets it). Without
it nothing is reloaded and a log line says so. Reloading a location restarts its code
server when it runs as ``dagster code-server start`` (``dagster dev`` does; in
Kubernetes use the Helm chart's ``codeServerArgs``); runs already going on are not
affected.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from conveyor.core.errors import ConveyorError

log = logging.getLogger("conveyor.config.reload")

DAGSTER_URL_ENV = "CONVEYOR_DAGSTER_URL"
SCHEDULER_SENSOR = "conveyor_scheduler"
# A reload that did not make the files and the location agree is asked again after this long.
RETRY_AFTER_S = 60.0

_RELOAD = """
mutation($name: String!) {
  reloadRepositoryLocation(repositoryLocationName: $name) {
    __typename
    ... on WorkspaceLocationEntry {
      name
      locationOrLoadError { __typename ... on PythonError { message } }
    }
    ... on ReloadNotSupported { message }
    ... on RepositoryLocationNotFound { message }
    ... on UnauthorizedError { message }
    ... on PythonError { message }
  }
}
"""

_LOCATIONS = """
{
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        locationOrLoadError {
          __typename
          ... on RepositoryLocation { repositories { sensors { name } } }
        }
      }
    }
  }
}
"""


class ReloadError(ConveyorError):
    """The webserver could not be reached or refused the reload."""


def dagster_url() -> str | None:
    url = os.environ.get(DAGSTER_URL_ENV, "").strip()
    return url.rstrip("/") or None


def _graphql(url: str, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(
        f"{url}/graphql", body, {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ReloadError(f"Dagster webserver at {url} unreachable: {e}") from e
    if out.get("errors"):
        raise ReloadError(f"Dagster webserver at {url}: {out['errors'][0].get('message')}")
    return out.get("data") or {}


def find_location(url: str) -> str:
    """The code location that holds the ``conveyor_scheduler`` sensor."""
    data = _graphql(url, _LOCATIONS)["workspaceOrError"]
    for entry in data.get("locationEntries") or []:
        loc = entry.get("locationOrLoadError") or {}
        for repo in loc.get("repositories") or []:
            if any(s["name"] == SCHEDULER_SENSOR for s in repo.get("sensors") or []):
                return str(entry["name"])
    names = [e["name"] for e in data.get("locationEntries") or []]
    if len(names) == 1:
        return str(names[0])  # a location that failed to load still has its name
    raise ReloadError(f"no Conveyor code location among {names} at {url}")


def reload_location(url: str, location: str | None = None) -> str:
    """Reload the code location (found by its scheduler sensor when not named); returns its name."""
    name = location or find_location(url)
    res = _graphql(url, _RELOAD, {"name": name})["reloadRepositoryLocation"]
    kind = res.get("__typename")
    if kind != "WorkspaceLocationEntry":
        raise ReloadError(f"reloading {name!r}: {kind}: {res.get('message')}")
    loaded = res.get("locationOrLoadError") or {}
    if loaded.get("__typename") == "PythonError":
        raise ReloadError(f"code location {name!r} failed to load: {loaded.get('message')}")
    return name


class ReloadRequests:
    """Asks for a reload at most once per target state (retried after ``RETRY_AFTER_S``), in the
    background: a sensor tick never waits for the code server it runs in to be replaced."""

    def __init__(self, clock: Any = time.monotonic):
        self._asked: dict[str, float] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self._first_seen: dict[str, float] = {}
        self._warned = False

    def request(
        self, target: str, reason: str, location: str | None = None, grace_s: float = 0.0
    ) -> bool:
        """Ask for a reload towards ``target`` (a fingerprint) once it has been wanted for
        ``grace_s`` (someone else, the API, may reload first); False when not asked now."""
        now = self._clock()
        with self._lock:
            first = self._first_seen.setdefault(target, now)
            self._first_seen = {target: first}
        if now - first < grace_s:
            return False
        url = dagster_url()
        if url is None:
            if not self._warned:
                log.warning(
                    "connector specs changed (%s) but %s is not set: reload the code location "
                    "by hand (Dagster UI: Deployment > Reload) or set it to the webserver's URL",
                    reason,
                    DAGSTER_URL_ENV,
                )
                self._warned = True
            return False
        with self._lock:
            last = self._asked.get(target)
            if last is not None and now - last < RETRY_AFTER_S:
                return False
            self._asked = {target: now}

        def run() -> None:
            try:
                name = reload_location(url, location)
                log.info("code location %s reloaded: %s", name, reason)
            except ReloadError as e:
                log.warning("could not reload the code location (%s): %s", reason, e)

        threading.Thread(target=run, name="conveyor-reload", daemon=True).start()
        return True


class CoalescingReloader:
    """Reloads on request from one background thread; requests that arrive while it waits
    or reloads become one more reload, not one each (a burst of API calls, one reload)."""

    def __init__(self, url: str, location: str | None = None, settle_s: float = 0.5):
        self.url = url
        self.location = location
        self.settle_s = settle_s
        self._wanted = threading.Event()
        self._reasons: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="conveyor-reloader", daemon=True)
        self._thread.start()

    def request(self, reason: str) -> None:
        with self._lock:
            self._reasons.append(reason)
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            time.sleep(self.settle_s)
            self._wanted.clear()
            with self._lock:
                reasons, self._reasons = self._reasons, []
            try:
                name = reload_location(self.url, self.location)
                self.location = name
                log.info("code location %s reloaded: %s", name, "; ".join(reasons))
            except ReloadError as e:
                log.warning("could not reload the code location (%s): %s", "; ".join(reasons), e)

"""Seeing a real 2-peer training swarm: /metrics, /status, /history, / and the status page in Chromium.

The browser test drives Debian's headless ``chromium`` over the Chrome DevTools protocol (a websocket,
through aiohttp) and saves a screenshot to ``artifacts/status-page.png`` for CI to keep.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from itertools import count, pairwise
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from tests.helpers import REPO

pytestmark = pytest.mark.integration

SYNTHETIC = REPO / "configs" / "synthetic.yaml"
SCREENSHOT = REPO / "artifacts" / "status-page.png"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
EXPECTED_FAMILIES = {
    "peerd_info", "peerd_swarm_peers", "peerd_training_step", "peerd_training_loss",
    "peerd_training_validation_loss",
    "peerd_training_samples_per_second", "peerd_averaging_rounds", "peerd_averaging_group_size",
    "peerd_averaging_round_duration_seconds", "peerd_sent_bytes", "peerd_received_bytes",
    "peerd_averaging_codec_error_ratio", "peerd_process_resident_memory_bytes", "peerd_expert_calls",
    "peerd_expert_call_errors", "peerd_expert_call_duration_seconds",
}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """Two training peers shared by this module's tests (the function-scoped env scrub runs too late)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("PEERD_")]:
            patch.delenv(key)
        log_dir = tmp_path_factory.mktemp("swarm")
        with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=["-o", "training.wait_for_peers=2"]) as local:
            local.start(2)
            # Status lists the records of a read up to one refresh period old (peerd.swarm.presence): one
            # peer0 began while peer1 was still starting can outlast peer0's first steps. Both listed first.
            local.wait_all_see_each_other()
            yield local


Metrics = dict[str, dict[tuple[tuple[str, str], ...], float]]


def get(peer: PeerProcess, path: str) -> tuple[str, str]:
    with urllib.request.urlopen(peer.control + path, timeout=10) as response:
        return response.headers.get("Content-Type", ""), response.read().decode()


def scrape(peer: PeerProcess) -> Metrics:
    content_type, text = get(peer, "/metrics")
    assert content_type.startswith("text/plain")
    metrics: Metrics = {}
    for family in text_string_to_metric_families(text):
        # a gauge's value, a counter's _total, a histogram's _count
        names = {family.name, family.name + "_total", family.name + "_count"}
        metrics[family.name] = {
            tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name in names
        }
    return metrics


def step_of(metrics: Metrics) -> float:
    return metrics["peerd_training_step"].get((), -1.0)


def scrape_past(peer: PeerProcess, step: float) -> Metrics | None:
    metrics = scrape(peer)
    return metrics if step_of(metrics) > step else None


@pytest.mark.timeout(150)
def test_metrics_status_and_page_follow_training(swarm: LocalSwarm) -> None:
    peer, other = swarm.peers
    first = wait_for(lambda: scrape_past(peer, 1), 60, "peer0 to reach step 2", 0.5)
    assert EXPECTED_FAMILIES <= set(first), EXPECTED_FAMILIES - set(first)
    assert all(name.startswith("peerd_") for name in first)
    second = wait_for(lambda: scrape_past(peer, step_of(first)), 60, "the step gauge to grow", 0.5)
    assert second["peerd_averaging_rounds"][(("result", "ok"),)] >= 1
    assert second["peerd_sent_bytes"][(("kind", "gradients"),)] > 0
    assert second["peerd_averaging_round_duration_seconds"][()] >= 1
    assert second["peerd_swarm_peers"][()] == 1
    assert second["peerd_process_resident_memory_bytes"][(("process", "children"),)] > 0  # DHT child + p2pd

    status = json.loads(get(peer, "/status")[1])
    assert status["peer_id"] == peer.peer_id and [p["peer_id"] for p in status["peers"]] == [other.peer_id]
    history = json.loads(get(peer, "/history?points=50")[1])["training"]
    assert len(history["loss"]) >= 2 and history["rounds"]
    content_type, page = get(peer, "/")
    assert content_type.startswith("text/html") and 'id="loss-chart"' in page

    # Peers log to files: no redrawn progress line there, periodic progress records instead.
    wait_for(lambda: "progress: step" in peer.log_path.read_text(), 30, "a periodic progress log record")
    assert "\r" not in peer.log_path.read_text() and "\x1b" not in peer.log_path.read_text()


class DevTools:
    """The least of the Chrome DevTools protocol: numbered commands and awaited events over one websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = count(1)
        self._events: list[str] = []
        self.errors: list[str] = []

    async def _next(self) -> dict[str, Any]:
        message = await self._ws.receive()
        if message.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"the browser closed the DevTools connection ({message.type.name})")
        data: dict[str, Any] = json.loads(message.data)
        method = data.get("method")
        if method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(data["params"]["exceptionDetails"])[:500])
        elif method == "Log.entryAdded" and data["params"]["entry"]["level"] == "error":
            self.errors.append(f"{data['params']['entry']['text']} {data['params']['entry'].get('url', '')}")
        if method:
            self._events.append(method)
        return data

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        while (data := await self._next()).get("id") != call_id:
            continue
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        if "exceptionDetails" in data["result"]:
            raise RuntimeError(f"{method}: {json.dumps(data['result']['exceptionDetails'])[:800]}")
        return dict(data["result"])

    async def event(self, method: str) -> None:
        """Returns once ``method`` has been received (also if it came in while a command was pending)."""
        while method not in self._events:
            await self._next()


# Resolves at the first render that shows another peer and a loss curve with enough points; the page fires
# `peerd:rendered` after every refresh, so nothing here guesses a delay.
WAIT_FOR_CURVE = """
new Promise((resolve) => {
  const check = () => {
    const chart = document.getElementById("loss-chart");
    const peers = document.querySelectorAll("#peers-table tbody tr.peer").length;
    const line = chart.querySelector("polyline.loss");
    const state = {
      points: Number(chart.dataset.points), validation: Number(chart.dataset.validationPoints),
      drawn: line ? line.points.numberOfItems : 0, dots: chart.querySelectorAll("circle.validation").length,
      peers, rounds: document.querySelectorAll("#rounds-table tbody tr").length,
      experts: document.getElementById("no-experts").textContent,
      stallShown: !document.getElementById("averaging-stalled").hidden,
    };
    const ready = state.points >= 5 && state.validation >= 2 && peers >= 1 && state.rounds >= 1;
    if (ready) resolve(state);
    return ready;
  };
  if (!check()) {
    document.addEventListener("peerd:rendered", function listener() {
      if (check()) document.removeEventListener("peerd:rendered", listener);
    });
  }
})
"""


# The y axis as drawn, and the page's own tick function on ranges the live run may not reach: the range from
# the issue that asked for it (labels were 4.46, 0.252, .0000452) and one under a decade and a half.
AXIS = """
({
  labels: Array.from(document.querySelectorAll("#loss-chart text.y-tick"), (t) => t.textContent),
  scale: document.getElementById("chart-scale").textContent,
  decades: yTicks(Math.log10(0.0000452), Math.log10(4.46), true).map((t) => t.label),
  narrow: yTicks(Math.log10(0.3), Math.log10(7), true).map((t) => t.label),
  linear: yTicks(2.4, 4.56, false).map((t) => t.label),
})
"""
ROUND_LOG_LABEL = re.compile(r"[125](e-?\d+)?|0\.0*[125]|[125]0*")


def devtools_port(profile: Path) -> int | None:
    """Chromium writes the port it chose for --remote-debugging-port=0 into this file once it listens."""
    try:
        first = (profile / "DevToolsActivePort").read_text().split("\n")[0]
    except FileNotFoundError:
        return None
    return int(first) if first.isdigit() else None


async def drive_page(port: int, page_url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        target = next(t for t in targets if t.get("type") == "page")
        async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 * 2**20) as ws:
            tools = DevTools(ws)
            for domain in ("Page", "Runtime", "Log"):
                await tools.send(f"{domain}.enable")
            await tools.send("Page.navigate", url=page_url)
            await tools.event("Page.loadEventFired")
            result = await tools.send("Runtime.evaluate", expression=WAIT_FOR_CURVE, awaitPromise=True,
                                      returnByValue=True, timeout=60000)
            state = dict(result["result"]["value"])
            axis = await tools.send("Runtime.evaluate", expression=AXIS, returnByValue=True)
            state["axis"] = axis["result"]["value"]
            metrics = await tools.send("Page.getLayoutMetrics")
            height = int(metrics["cssContentSize"]["height"]) + 1
            await tools.send("Emulation.setDeviceMetricsOverride", width=1280, height=height,
                             deviceScaleFactor=1, mobile=False)
            shot = await tools.send("Page.captureScreenshot", format="png")
            state["png"] = base64.b64decode(shot["data"])
            state["errors"] = tools.errors
            return state


@pytest.mark.timeout(150)
def test_status_page_renders_peers_and_the_loss_curve_in_chromium(
    swarm: LocalSwarm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM}: scripts/install-system-packages.sh (run by scripts/test) "
                    "installs Debian's `chromium` package when apt-get is available (as root or with "
                    "passwordless sudo); without it this test cannot run")
    peer = swarm.peers[0]
    wait_for(lambda: (peer.status()["training"] or {}).get("step", 0) >= 12, 60, "peer0 to reach step 12",
             0.5)
    profile = tmp_path / "chromium-profile"
    with open(tmp_path / "chromium.log", "wb") as log:
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1280,900",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        port = wait_for(lambda: devtools_port(profile), 30, "chromium's DevTools port")
        state = asyncio.run(asyncio.wait_for(drive_page(port, peer.control + "/"), 90))
    finally:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.wait(10)
    assert state["errors"] == [], state["errors"]  # no script error, no blocked or failed request
    assert state["drawn"] == state["points"] >= 5 and state["dots"] == state["validation"] >= 2
    assert state["peers"] == 1 and "No peer in the swarm serves experts" in state["experts"]
    assert state["stallShown"] is False  # the peers average: no "averaging has stopped" banner
    axis = state["axis"]
    assert axis["decades"] == ["1e-4", "0.001", "0.01", "0.1", "1"]
    assert axis["narrow"] == ["0.5", "1", "2", "5"] and axis["linear"] == ["2.5", "3.0", "3.5", "4.0", "4.5"]
    assert len(axis["labels"]) >= 2, axis
    if axis["scale"] == "(log scale)":
        assert all(ROUND_LOG_LABEL.fullmatch(label) for label in axis["labels"]), axis
    else:  # evenly spaced round numbers
        values = [float(label) for label in axis["labels"]]
        assert len({round(b - a, 9) for a, b in pairwise(values)}) <= 1, axis
    assert state["png"].startswith(b"\x89PNG") and len(state["png"]) > 10_000
    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.write_bytes(state["png"])
    with capsys.disabled():
        print(f"\nstatus page screenshot: {SCREENSHOT}")

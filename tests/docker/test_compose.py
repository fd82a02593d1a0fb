"""The docker-compose swarm of docker-compose.yml, for real: image, bootstrap, expert host and 3 trainers.

It does what a user does: the image is built as `scripts/compose-up --no-up` builds it (Docker engine, base
image, host wheelhouse: no registry here), then `docker-compose config` and `docker-compose up` run on the
compose file alone in a fresh directory, with no .env and no bootstrap key (the bootstrap peer makes its own
identity and shares its address through a volume; only SWARM_IMAGE and SWARM_BOOTSTRAP_PUBLISH are set, so the
test's image and port do not collide with a user's). The swarm is judged from outside through each peer's
control endpoint (`docker exec <container>` + GET /status and /history on the container's loopback: the JSON
of `peerd status --json`), never from which container exits first:

- every trainer completes >= 3 averaging rounds in groups of >= 3 peers, and its loss falls;
- the expert host serves the trainers' MoE calls (forward and backward, its experts update);
- the bootstrap peer lists every other peer, and a peer outside Docker joins through the published address;
- after `docker kill` of one trainer, each remaining trainer completes >= 2 more rounds without it.

The project is torn down before (leftovers of an interrupted run) and after, also on failure. Where Docker
cannot be had (no root, no apt), the test skips with the reason, or fails when CI=true. Deselect: -m 'not docker'.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from peerd.errors import PeerdError
from peerd.launcher import PeerProcess, wait_for

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
PROJECT = "peerd-ci"
IMAGE = "peerd:ci"
TRAINERS = 3
POLL = 2.0  # seconds between status polls of a bounded wait
LOCK_PATH = Path(tempfile.gettempdir()) / "peerd-compose-test.lock"
ARTIFACT = REPO / "artifacts" / "docker-compose-test.log"
# Runs inside a container: the control endpoint listens on the container's loopback only.
FETCH = (
    "import json, sys, urllib.request as u\n"
    "get = lambda p: json.load(u.urlopen('http://127.0.0.1:7710' + p, timeout=10))\n"
    "print(json.dumps({p: get(p) for p in sys.argv[1:]}))"
)


def _docker_unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"Docker is required in CI: {reason}")
    pytest.skip(f"Docker cannot run here: {reason}")


def _run(args: list[str], env: dict[str, str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


class NotAnswering(Exception):
    """A peer's control endpoint did not answer (yet)."""


class ComposeSwarm:
    def __init__(self, compose: list[str], compose_file: Path, env: dict[str, str]) -> None:
        self.compose = compose
        self.compose_file = compose_file
        self.env = env
        self.last: dict[str, dict[str, Any]] = {}  # container -> its last answer, for failure messages

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self.compose, "-p", PROJECT, "-f", str(self.compose_file), *args], self.env, timeout, check)

    def containers(self, service: str) -> list[str]:
        """Names of the service's running containers, sorted."""
        out = _run(["docker", "ps", "--format", "{{.Names}}",
                    "--filter", f"label=com.docker.compose.project={PROJECT}",
                    "--filter", f"label=com.docker.compose.service={service}"], self.env, 30).stdout
        return sorted(out.split())

    def query(self, container: str, *paths: str) -> dict[str, Any]:
        """The control endpoint's answers; raises NotAnswering while the peer is still starting (or dead)."""
        result = _run(["docker", "exec", container, "python3", "-c", FETCH, *paths], self.env, 30, check=False)
        if result.returncode != 0:
            error = (result.stderr.strip().splitlines() or ["no output"])[-1]
            self.last[container] = {"error": error}
            raise NotAnswering(f"{container}: {error}")
        answer: dict[str, Any] = json.loads(result.stdout)
        self.last[container] = answer
        return answer

    def status(self, container: str) -> dict[str, Any]:
        status: dict[str, Any] = self.query(container, "/status")["/status"]
        return status

    def expect_running(self, service: str, containers: list[str]) -> None:
        """Fails at once, with the container's last log lines, when one that should run has exited."""
        running = set(self.containers(service))
        for container in containers:
            if container not in running:
                state = _run(["docker", "inspect", "-f", "{{.State.Status}} exit code {{.State.ExitCode}}",
                              container], self.env, 30, check=False).stdout.strip()
                tail = _run(["docker", "logs", "--tail", "25", container], self.env, 30, check=False)
                raise AssertionError(f"{container} is no longer running ({state}):\n{tail.stdout}{tail.stderr}")

    def summary(self) -> str:
        for container in list(self.last):  # fresh answers where possible, not the last successful poll's
            try:
                self.query(container, "/status", "/history?points=1000")
            except NotAnswering:
                pass
        lines = []
        for container, answer in sorted(self.last.items()):
            if "error" in answer:
                lines.append(f"  {container}: {answer['error']}")
                continue
            status = answer.get("/status", {})
            training = status.get("training") or {}
            rounds = _rounds(answer) if "/history?points=1000" in answer else []
            lines.append(f"  {container}: step {training.get('step')} loss {training.get('loss')} rounds_ok "
                         f"{training.get('rounds_ok')} solo {training.get('rounds_solo')} group sizes "
                         f"{[r.get('group_size') for r in rounds[-8:]]} peers {len(status.get('peers', []))}")
        return "\n".join(lines)

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        def check() -> bool:
            try:
                return condition()
            except NotAnswering:
                return False

        started = time.monotonic()
        try:
            wait_for(check, timeout, what, interval=POLL)
        except TimeoutError as e:
            raise AssertionError(f"{e}; last status:\n{self.summary()}") from None
        return time.monotonic() - started


@pytest.fixture
def lock() -> Iterator[None]:
    """One compose test per machine at a time: they share the project name, the image tag and the CPU."""
    with open(LOCK_PATH, "w") as handle:
        deadline = time.monotonic() + 900
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another compose test held {LOCK_PATH} for 15 minutes")
                time.sleep(1.0)  # polling a lock held by another run
        yield


def _history(answer: dict[str, Any]) -> dict[str, Any]:
    """GET /history: {"training": {"loss": [[time, step, loss], ...], "rounds": [...], ...}}."""
    return dict(answer["/history?points=1000"]["training"] or {"loss": [], "validation_loss": [], "rounds": []})


def _rounds(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_history(answer)["rounds"])


def _server_experts(status: dict[str, Any]) -> dict[str, Any]:
    section = status.get("experts") or {}
    server = section.get("server") or {}
    return dict(server.get("experts") or {})


def _client_calls(status: dict[str, Any]) -> int:
    client = (status.get("experts") or {}).get("client") or {}
    return sum(int(e.get("forward", {}).get("calls", 0)) - int(e.get("forward", {}).get("errors", 0))
               for e in (client.get("experts") or {}).values())


@pytest.mark.timeout(1500)
def test_compose_swarm_trains_serves_experts_and_survives_a_killed_trainer(
    tmp_path: Path, lock: None, capsys: pytest.CaptureFixture[str]
) -> None:
    times: dict[str, float] = {}
    started = time.monotonic()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PEERD_", "SWARM_", "COMPOSE_"))}

    engine = subprocess.run(["bash", "scripts/docker-engine"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    if engine.returncode == 3:
        _docker_unavailable(engine.stderr.strip().splitlines()[-1] if engine.stderr.strip() else "unknown")
    assert engine.returncode == 0, engine.stderr
    compose = engine.stdout.split()
    times["engine"] = time.monotonic() - started

    # A fresh directory with the compose file alone: no .env, no key, nothing a script wrote.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(REPO / "docker-compose.yml", fresh / "docker-compose.yml")
    assert not (fresh / ".env").exists()
    # only the test's own image tag and a free host port: a user's peerd:latest and 31337 are left alone
    swarm = ComposeSwarm(compose, fresh / "docker-compose.yml",
                         {**env, "SWARM_IMAGE": IMAGE, "SWARM_BOOTSTRAP_PUBLISH": "127.0.0.1:"})
    # leftovers of an interrupted earlier run go first, volumes too: the bootstrap identity is made anew
    swarm.run("down", "-v", "--remove-orphans", "-t", "5", timeout=120)

    # `config` as a user meets it: not one variable set
    config = ComposeSwarm(compose, fresh / "docker-compose.yml", env).run("config", timeout=60)
    assert "bootstrap:" in config.stdout and "image: peerd:latest" in config.stdout, config.stdout
    assert "WARNING" not in config.stderr and "is not set" not in config.stderr, config.stderr

    phase = time.monotonic()
    _run(["bash", "scripts/compose-up", "--no-up"], {**env, "SWARM_IMAGE": IMAGE}, timeout=1200)
    times["image (base image, wheelhouse, build)"] = time.monotonic() - phase

    try:
        phase = time.monotonic()
        swarm.run("up", "-d", "--scale", f"trainer={TRAINERS}", timeout=400)
        times["up (bootstrap and expert host healthy, trainers started)"] = time.monotonic() - phase
        trainers = swarm.containers("trainer")
        (bootstrap,) = swarm.containers("bootstrap")
        (experts,) = swarm.containers("experts")
        assert len(trainers) == TRAINERS, trainers
        shared = _run(["docker", "exec", bootstrap, "cat", "/swarm/bootstrap.maddr"], env, 30).stdout.strip()
        assert shared.startswith("/dns/bootstrap/tcp/31337/p2p/"), shared
        bootstrap_id = shared.rsplit("/", 1)[1]

        # 1. every trainer: >= 3 rounds in groups of >= 3, loss fallen; the expert host serves their MoE calls
        def trained(container: str) -> bool:
            answer = swarm.query(container, "/status", "/history?points=1000")
            training = answer["/status"]["training"]
            curve = _history(answer)["loss"]
            big_rounds = [r for r in _rounds(answer) if r["group_size"] >= 3]
            fallen = len(curve) >= 4 and sum(p[2] for p in curve[-3:]) / 3 < curve[0][2] - 1.0
            return training["rounds_ok"] >= 3 and len(big_rounds) >= 3 and fallen

        def served() -> bool:
            experts_status = swarm.status(experts)
            server = _server_experts(experts_status)
            return (sum(int(e["forward"]["calls"]) for e in server.values()) > 0
                    and sum(int(e.get("updates", 0)) for e in server.values()) > 0)

        phase = time.monotonic()
        def all_trained() -> bool:
            swarm.expect_running("trainer", trainers)
            swarm.expect_running("experts", [experts])
            return all(trained(c) for c in trainers) and served()

        swarm.wait(all_trained, 300,
                   f"all {TRAINERS} trainers to average >= 3 rounds in groups >= 3 with falling loss")
        times["train (>= 3 rounds in groups >= 3 each)"] = time.monotonic() - phase

        answers = {c: swarm.query(c, "/status", "/history?points=1000") for c in trainers}
        statuses = {c: a["/status"] for c, a in answers.items()}
        fingerprints = {s["training"]["fingerprint"] for s in statuses.values()}
        assert len(fingerprints) == 1, fingerprints
        for container, answer in answers.items():
            training = answer["/status"]["training"]
            assert not training["foreign_peers"], (container, training["foreign_peers"])
            assert training["loss"] is not None and math.isfinite(training["loss"]), training
            first = _history(answer)["loss"][0][2]  # step 0: ~ln(256) = 5.55 nats/byte
            assert training["loss"] < first, (container, training["loss"], first)  # the smoothed loss fell too
            assert _client_calls(answer["/status"]) > 0, (container, answer["/status"]["experts"])
        server = _server_experts(swarm.status(experts))
        assert server, swarm.last[experts]
        for uid, info in server.items():
            assert info["forward"]["errors"] == 0, (uid, info)

        # every peer is known to the bootstrap peer (whose address the others were given)
        others = {s["peer_id"] for s in statuses.values()} | {swarm.last[experts]["/status"]["peer_id"]}
        swarm.wait(lambda: others <= {p["peer_id"] for p in swarm.status(bootstrap)["peers"]}, 30,
                   "the bootstrap peer to list every trainer and the expert host")
        assert swarm.last[bootstrap]["/status"]["peer_id"] == bootstrap_id

        # `peerd status --json`, as docs/docker.md tells users, answers inside a container too
        shown = json.loads(_run(["docker", "exec", trainers[0], "peerd", "status", "--json"], env, 60).stdout)
        assert shown["training"]["rounds_ok"] >= 3

        # 2. a peer outside Docker joins through the bootstrap's published address and sees the swarm
        phase = time.monotonic()
        port = _run(["docker", "port", bootstrap, "31337/tcp"], env, 30).stdout.split()[0].rsplit(":", 1)[1]
        outside = PeerProcess("outside", [
            "--config", str(REPO / "configs" / "docker.yaml"),
            "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{bootstrap_id}",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--control-port", "0",
            "-o", "training.enabled=false", "-o", "experts=null", "-o", "swarm.roles=[observer]",
        ], log_dir=tmp_path)
        try:
            outside.wait_ready(90)
            wait_for(lambda: others <= outside.seen_peer_ids(), 60, "the outside peer to see the swarm", POLL)
        except (TimeoutError, PeerdError) as e:
            raise AssertionError(f"outside peer: {e}\n{outside.log_tail()}") from None
        finally:
            code = outside.stop()
        assert code == 0, outside.log_tail()
        times["outside peer joins"] = time.monotonic() - phase

        # 3. kill one trainer: the others go on averaging without it
        victim, survivors = trainers[-1], trainers[:-1]
        killed_at = time.time()
        _run(["docker", "kill", victim], env, 60)
        assert victim not in swarm.containers("trainer")

        def recovered(container: str) -> bool:
            answer = swarm.query(container, "/status", "/history?points=1000")
            after = [r for r in _rounds(answer) if r["time"] > killed_at]
            return len(after) >= 2 and after[-1]["group_size"] == len(survivors)

        phase = time.monotonic()
        def all_recovered() -> bool:
            swarm.expect_running("trainer", survivors)  # the kill must not take any other peer down
            return all(recovered(c) for c in survivors)

        swarm.wait(all_recovered, 180,
                   f">= 2 more rounds of the {len(survivors)} remaining trainers after killing {victim}")
        times["recover (>= 2 rounds after docker kill)"] = time.monotonic() - phase
        for container in survivors:
            training = swarm.status(container)["training"]
            assert math.isfinite(training["loss"]), training
        assert sorted(swarm.containers("trainer")) == survivors
    finally:
        phase = time.monotonic()
        logs = swarm.run("logs", "--no-color", "--timestamps", timeout=120, check=False)
        ARTIFACT.parent.mkdir(exist_ok=True)
        ARTIFACT.write_text(f"{swarm.summary()}\n\n{logs.stdout}{logs.stderr}")
        down = swarm.run("down", "-v", "--remove-orphans", "-t", "10", timeout=180, check=False)
        times["teardown"] = time.monotonic() - phase
        times["total"] = time.monotonic() - started
        with capsys.disabled():
            print(f"\ncompose test ({' '.join(compose)}), logs in {ARTIFACT.relative_to(REPO)}:", file=sys.stderr)
            for name, seconds in times.items():
                print(f"  {name}: {seconds:.1f} s", file=sys.stderr)
    assert down.returncode == 0, down.stderr
    left = _run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], env, 30).stdout
    assert not left.split(), f"containers left behind: {left}"

"""What the daemon shows about itself: metrics, training history, the control routes, terminal progress."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from peerd.averaging.group import RoundReport
from peerd.config import ControlConfig, LoggingConfig
from peerd.control.server import ControlServer
from peerd.control.terminal import TerminalProgress, format_progress, is_live_terminal
from peerd.metrics import ROUND_DURATION_BUCKETS, DaemonMetrics, Distribution
from peerd.training.report import TrainingReport

PEER = "12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"


def fake_status(training: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The shape of ``Daemon.status()``, with one other peer seen."""
    return {
        "peer_id": PEER, "run_name": "test-run", "software_version": "0.1.0", "state": "training",
        "uptime": 12.5, "peers": [{"peer_id": "other"}], "dht_error": None, "training": training, **extra,
    }


def fake_training() -> dict[str, Any]:
    report = TrainingReport(fingerprint="f" * 16, parameters=1234)
    report.step = 7
    report.record_loss(0.5, samples=32, seconds=0.1)
    report.rounds_solo = 2
    for duration in (0.02, 0.3, 0.3, 100.0):
        report.record_round(RoundReport(round_id="r", group_size=3, duration=duration, bytes_sent=1000,
                                        bytes_received=900, codec_error=0.01, excluded={"x": "timeout"}))
    report.record_traffic("state", 50, 60)
    report.validation_loss, report.validation_step = 0.4, 5
    report.peers_training = 3
    return report.as_dict()


def parse(text: bytes) -> tuple[dict[str, Any], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    families = {family.name: family for family in text_string_to_metric_families(text.decode())}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in families.values():
        for sample in family.samples:
            assert isinstance(sample, Sample)
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families, samples


def test_metrics_parse_carry_the_prefix_and_reflect_the_snapshot() -> None:
    families, samples = parse(DaemonMetrics().render(fake_status(fake_training(), dht_requests_cut=3)))
    assert families and all(name.startswith("peerd_") for name in families)
    assert samples[("peerd_dht_requests_cut_total", ())] == 3
    assert samples[("peerd_training_step", ())] == 7
    assert samples[("peerd_training_loss", ())] == 0.5
    assert samples[("peerd_training_validation_loss", ())] == 0.4
    assert samples[("peerd_training_peers", ())] == 3
    assert samples[("peerd_swarm_peers", ())] == 1
    assert samples[("peerd_uptime_seconds", ())] == 12.5
    assert samples[("peerd_info", (("peer_id", PEER), ("run_name", "test-run"), ("version", "0.1.0")))] == 1
    assert samples[("peerd_averaging_rounds_total", (("result", "ok"),))] == 4
    assert samples[("peerd_averaging_rounds_total", (("result", "solo"),))] == 2
    assert samples[("peerd_averaging_group_size", ())] == 3
    assert samples[("peerd_averaging_excluded_peers", ())] == 1
    assert samples[("peerd_sent_bytes_total", (("kind", "gradients"),))] == 4000
    assert samples[("peerd_received_bytes_total", (("kind", "gradients"),))] == 3600
    assert samples[("peerd_sent_bytes_total", (("kind", "state"),))] == 50
    # Cumulative buckets: 0.02 <= 0.05; two 0.3 <= 0.5; 100 only in +Inf.
    hist = "peerd_averaging_round_duration_seconds"
    assert samples[(f"{hist}_bucket", (("le", "0.05"),))] == 1
    assert samples[(f"{hist}_bucket", (("le", "0.5"),))] == 3
    assert samples[(f"{hist}_bucket", (("le", "60.0"),))] == 3
    assert samples[(f"{hist}_bucket", (("le", "+Inf"),))] == 4
    assert samples[(f"{hist}_count", ())] == 4 and math.isclose(samples[(f"{hist}_sum", ())], 100.62)
    assert samples[("peerd_expert_calls_total", ())] == 0
    assert samples[("peerd_expert_call_errors_total", ())] == 0
    assert samples[("peerd_averaging_round_sent_bytes", ())] == 1000
    assert samples[("peerd_averaging_round_received_bytes", ())] == 900
    assert ("peerd_averaging_codec_density", ()) not in samples  # blockwise8: no density to report
    assert samples[("peerd_process_resident_memory_bytes", (("process", "daemon"),))] > 10 * 2**20


def test_the_codec_scheme_density_and_value_bits_are_reported() -> None:
    training = {**fake_training(), "codec_scheme": "topk", "codec_kernel": "avx2", "codec_density": 0.0156,
                "codec_value_bits": 2}
    _, samples = parse(DaemonMetrics().render(fake_status(training)))
    assert samples[("peerd_averaging_codec_info", (("kernel", "avx2"), ("scheme", "topk")))] == 1
    assert samples[("peerd_averaging_codec_density", ())] == 0.0156
    assert samples[("peerd_averaging_codec_value_bits", ())] == 2


def test_membership_refusals_are_counted_by_reason() -> None:
    membership = {"mode": "private (swarm secret)", "streams_open": 2, "streams_accepted": 40, "pending_bytes": 512,
                  "streams_refused": {"HANDSHAKE_NOT_A_MEMBER": 3, "busy": 1}, "peers_disconnected": 2}
    _, samples = parse(DaemonMetrics().render(fake_status(membership=membership)))
    assert samples[("peerd_streams_refused_total", (("reason", "HANDSHAKE_NOT_A_MEMBER"),))] == 3
    assert samples[("peerd_streams_refused_total", (("reason", "busy"),))] == 1
    assert samples[("peerd_streams_accepted_total", ())] == 40
    assert samples[("peerd_peers_disconnected_total", ())] == 2
    assert samples[("peerd_streams_open", ())] == 2 and samples[("peerd_streams_pending_bytes", ())] == 512


def test_missing_values_leave_families_without_samples_instead_of_zeros() -> None:
    families, samples = parse(DaemonMetrics().render(fake_status(None, dht_error="lookup timed out")))
    for name in ("peerd_training_step", "peerd_training_loss", "peerd_swarm_peers",
                 "peerd_averaging_group_size"):
        assert name in families and families[name].samples == [], name
    assert samples[("peerd_averaging_round_duration_seconds_count", ())] == 0
    # Expert families exist from the start: no expert call has happened, which is what zero says.
    assert samples[("peerd_expert_calls_total", ())] == 0
    assert samples[("peerd_expert_call_duration_seconds_count", ())] == 0


def test_process_memory_includes_the_daemons_children() -> None:
    # the child says when its interpreter is up: right after exec its resident memory can still be under 1 MiB
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        _, samples = parse(DaemonMetrics().render({}))
        assert samples[("peerd_process_children", ())] >= 1
        assert samples[("peerd_process_resident_memory_bytes", (("process", "children"),))] > 2**20
    finally:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.wait(10)
        child.stdout.close()


def test_distribution_buckets_are_inclusive_upper_bounds_and_skip_nan() -> None:
    dist = Distribution(ROUND_DURATION_BUCKETS)
    for value in (0.05, 0.051, 1000.0, float("nan")):
        dist.observe(value)
    assert dist.counts[0] == 1 and dist.counts[1] == 1 and dist.counts[-1] == 1 and sum(dist.counts) == 3
    assert math.isclose(dist.total, 1000.101)


def test_history_has_one_point_per_step_validations_and_recent_rounds() -> None:
    report = TrainingReport(fingerprint="f" * 16, parameters=10)
    old_keys = {"fingerprint", "parameters", "state", "step", "loss", "validation_loss", "validation_step",
                "samples_per_second", "swarm_samples_per_second", "peers_training", "rounds_ok",
                "rounds_solo",
                "state_syncs", "bytes_sent", "bytes_received", "last_round", "foreign_peers"}
    assert old_keys <= set(report.as_dict())
    for step, losses in enumerate([(1.0, 3.0), (0.5,), (0.25, 0.75)]):
        report.step = step
        for loss in losses:
            report.record_loss(loss, samples=8, seconds=0.01)
        if step == 1:
            report.validation_loss, report.validation_step = 0.6, 1
    history = report.history()
    assert [(step, loss) for _, step, loss in history["loss"]] == [(0, 2.0), (1, 0.5), (2, 0.5)]
    assert [(step, loss) for _, step, loss in history["validation_loss"]] == [(1, 0.6)]
    assert [point[1] for point in report.history(points=2)["loss"]] == [1, 2]
    for i in range(25):
        report.record_round(RoundReport(round_id=str(i), group_size=2, duration=0.1))
    assert len(history := report.history()["rounds"]) == 20 and history[-1]["group_size"] == 2


async def _serve_and_fetch(paths: list[str]) -> dict[str, tuple[int, str, str]]:
    training = fake_training()
    training["loss"] = float("nan")

    async def status() -> dict[str, Any]:
        return fake_status(training)

    def history(points: int) -> dict[str, Any]:
        return {"loss": [[0, 1, 2]][:points]}

    server = await ControlServer.create(ControlConfig(port=0), status, history)
    try:
        results = {}
        async with aiohttp.ClientSession() as session:
            for path in paths:
                async with session.get(server.url + path) as response:
                    content_type = response.headers.get("Content-Type", "")
                    results[path] = (response.status, content_type, await response.text())
                    if path == "/":
                        assert "default-src 'self'" in response.headers["Content-Security-Policy"]
        return results
    finally:
        await server.shutdown()


def test_control_routes_serve_json_metrics_and_the_page() -> None:
    paths = ["/status", "/history?points=1", "/history?points=abc", "/metrics", "/", "/static/status.js",
             "/static/../server.py"]
    got = asyncio.run(_serve_and_fetch(paths))
    assert got["/status"][0] == 200
    assert json.loads(got["/status"][2])["training"]["loss"] is None  # NaN -> null
    assert got["/history?points=1"][0] == 200 and json.loads(got["/history?points=1"][2]) == {
        "training": {"loss": [[0, 1, 2]]}}
    assert got["/history?points=abc"][0] == 400
    assert got["/metrics"][0] == 200 and got["/metrics"][1].startswith("text/plain")
    assert "peerd_training_step 7.0" in got["/metrics"][2]
    assert got["/"][0] == 200 and 'id="loss-chart"' in got["/"][2]
    assert "http" not in got["/"][2].split("<body")[0]  # assets only from this daemon
    assert got["/static/status.js"][0] == 200 and "/history" in got["/static/status.js"][2]
    assert got["/static/../server.py"][0] in (403, 404)


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run_progress(config: LoggingConfig, snapshot: dict[str, Any], stream: io.StringIO) -> TerminalProgress:
    """Draws once, logs a record through the root handler on ``stream``, draws again, stops."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    saved = root.handlers[:]
    root.handlers[:] = [handler]

    async def scenario() -> TerminalProgress:
        progress = TerminalProgress.start(config, lambda: snapshot, stream)
        progress.tick()
        logging.getLogger("peerd.test").warning("a log record")
        snapshot["step"] += 1
        progress.tick()
        await progress.stop()
        return progress

    try:
        return asyncio.run(scenario())
    finally:
        root.handlers[:] = saved


def test_progress_line_redraws_in_place_and_log_records_print_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    stream = FakeTty()
    snapshot = {"step": 3, "loss": 0.25, "samples_per_second": 100.0, "peers_training": 2, "state": "training"}
    progress = _run_progress(LoggingConfig(format="text"), snapshot, stream)
    assert progress.live
    first, last = format_progress({**snapshot, "step": 3}), format_progress(snapshot)
    assert "step 3" in first and "loss 0.2500" in first and "100.0 samples/s" in first and "2 peers" in first
    cursor = re.compile(r"\x1b\[\?25[hl]")
    # rich hides the cursor while live; shown again before the line, so a killed daemon leaves it visible
    assert cursor.findall(stream.getvalue().split(first)[0])[-1:] in ([], ["\x1b[?25h"])
    out = cursor.sub("", stream.getvalue())
    erase = "\r\x1b[2K"
    # drawn; erased for the record, which ends its own line with the handler's format; redrawn below it;
    # redrawn in place with the next snapshot; left in the scrollback at stop, on a line of its own.
    assert out == f"{first}{erase}[peerd.test] a log record\n{first}{erase}{last}{erase}{last}\n"


def test_progress_line_is_cut_at_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    stream = FakeTty()
    _run_progress(LoggingConfig(format="text"), {"step": 3, "loss": 0.25}, stream)
    drawn = re.sub(r"\x1b\[\?25[hl]", "", stream.getvalue()).split("\r\x1b[2K")[-1].rstrip("\n")
    assert drawn.startswith("step 4 | loss 0.2500") and len(drawn) == 40 and drawn.endswith("…")


def test_no_progress_line_in_pipes_files_or_json_logs(caplog: pytest.LogCaptureFixture) -> None:
    assert not is_live_terminal(FakeTty(), LoggingConfig(format="json"))
    assert not is_live_terminal(io.StringIO(), LoggingConfig(format="text"))
    for config, stream in [(LoggingConfig(format="text"), io.StringIO()), (LoggingConfig(format="json"), FakeTty())]:
        with caplog.at_level(logging.INFO, logger="peerd.control.terminal"):
            progress = _run_progress(config, {"step": 9}, stream)
        assert not progress.live
        # only the handler's own lines, the progress among them as records: no escape code, no carriage return
        assert stream.getvalue() == (f"[peerd.control.terminal] progress: {format_progress({'step': 9})}\n"
                                     "[peerd.test] a log record\n"
                                     f"[peerd.control.terminal] progress: {format_progress({'step': 10})}\n")


def test_a_lora_run_shows_its_trainable_share_round_bytes_against_full_and_tokens_per_second() -> None:
    from peerd.tables import format_status

    report = TrainingReport(fingerprint="ab" * 4, parameters=2048, model_parameters=204800, tokens_per_sample=128)
    report.record_loss(3.0, samples=8, seconds=0.5)
    report.record_round(RoundReport(round_id="r", group_size=3, duration=0.1, bytes_sent=3000, bytes_received=2000))
    training = report.as_dict()
    assert training["round_bytes"] == {"trainable": 5000, "all_parameters": 500000}
    assert training["tokens_per_second"] == 8 * 128 / 0.5 and training["samples_trained"] == 8
    text = format_status({"peer_id": "me", "peers": [], "training": training})
    assert "2,048 of 204,800 parameters train (1.00%)" in text
    assert "a round moves 5 KiB, against ~488 KiB training all of them" in text
    assert "2048 tokens/s" in format_progress(training)
    full = TrainingReport(fingerprint="ab" * 4, parameters=10, model_parameters=10).as_dict()
    assert "parameters train" not in format_status({"peer_id": "me", "peers": [], "training": full})
    assert "tokens/s" not in format_progress(full)

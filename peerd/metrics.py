"""Prometheus metrics of one daemon, rendered at scrape time from the snapshot ``GET /status`` returns.

Nothing here counts events as they happen. A custom collector reads the daemon's status snapshot (the
mapping `peerd status --json` prints; its ``training`` part is ``TrainingReport.as_dict()``) and this
process tree's memory and CPU through psutil. So every daemon has its own registry, there is no global
state, and this floor-1 module imports nothing from training or averaging. :class:`Distribution` is the
one thing components record into: a fixed-bucket histogram kept in their own reports and exposed here as
a Prometheus histogram.

Snapshot keys read (all optional; a missing value gives a family without samples, never a made-up zero):
``peer_id``, ``run_name``, ``software_version``, ``uptime``, ``peers`` (absent when ``dht_error`` is set),
``records_dropped`` (reason -> count), ``membership`` (``streams_refused``: reason -> count,
``streams_accepted``, ``streams_open``, ``pending_bytes``), ``reachability`` (``state``, ``connections``,
``relay_service``: ``bytes_relayed``, ``circuits_total``, ``circuits_open``, ``reservations_open``),
``training`` (see ``TrainingReport.as_dict``) and ``experts`` (``calls``, ``errors``, ``latency``, reported
once this daemon hosts or calls experts; until then those families hold zeros, which is what happened).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

ROUND_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
EXPERT_CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


@dataclass
class Distribution:
    """Counts of observed values per bucket (upper bounds inclusive, one overflow bucket) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return  # a NaN would poison the sum forever
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def as_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


def _histogram(name: str, doc: str, data: Any, bounds: Sequence[float]) -> HistogramMetricFamily:
    """Cumulative Prometheus buckets from a ``Distribution.as_dict()``; empty buckets when there is none."""
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    if isinstance(data, Mapping) and list(data.get("bounds", ())) == list(bounds):
        raw = data.get("counts")
        if isinstance(raw, list) and len(raw) == len(counts) and all(isinstance(c, int) for c in raw):
            counts, total = raw, float(data.get("sum") or 0.0)
    buckets, running = [], 0
    for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        running += count
        buckets.append((bound, float(running)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


_TRAINING_GAUGES = (  # name, key in TrainingReport.as_dict(), help
    ("peerd_training_step", "step", "Global optimizer step this peer is at (in diloco mode: the phase)."),
    ("peerd_training_inner_steps", "inner_steps", "diloco: inner steps taken in the current phase."),
    ("peerd_training_utilisation", "utilisation",
     "Share of wall time since the first step spent in forward, backward and inner optimizer steps."),
    ("peerd_training_loss", "loss", "Exponential moving average of micro-batch training losses."),
    ("peerd_training_validation_loss", "validation_loss", "Loss on the task's fixed validation batches."),
    ("peerd_training_validation_step", "validation_step", "Step at which the validation loss was computed."),
    ("peerd_training_samples_per_second", "samples_per_second",
     "Samples this peer processes per second of compute."),
    ("peerd_training_swarm_samples_per_second", "swarm_samples_per_second",
     "Samples per second over the swarm's trainers."),
    ("peerd_training_peers", "peers_training",
     "Trainers of this model (this one included) with live progress."),
    ("peerd_training_parameters", "parameters", "Trainable parameters of the model: what rounds average."),
    ("peerd_training_model_parameters", "model_parameters",
     "All parameters of the model, frozen ones (a LoRA run's base model) included."),
    ("peerd_training_tokens_per_second", "tokens_per_second",
     "Language-model tasks: tokens this peer trains on per second of compute."),
)


def _mapping(data: Mapping[str, Any] | None, key: str) -> Mapping[str, Any] | None:
    value = data.get(key) if data is not None else None
    return value if isinstance(value, Mapping) else None


def _number(data: Mapping[str, Any] | None, key: str) -> float | None:
    value = data.get(key) if data is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def _by_label(family: Family, counts: Mapping[str, Any] | None) -> Family:
    """``family`` (one label) with a sample per numeric entry of ``counts`` (label value -> number)."""
    for label in counts or {}:
        if (value := _number(counts, label)) is not None:
            family.add_metric([str(label)], value)
    return family


def _counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


class StatusCollector(Collector):
    """Turns one status snapshot plus the process tree into metric families."""

    def __init__(self, process: psutil.Process | None = None) -> None:
        self.snapshot: Mapping[str, Any] = {}
        self._process = process or psutil.Process()

    def collect(self) -> Iterator[Metric]:
        status = self.snapshot
        yield from self._identity(status)
        yield from self._training(_mapping(status, "training"))
        yield from self._experts(_mapping(status, "experts"))
        yield from self._processes()

    def _identity(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        info = GaugeMetricFamily("peerd_info", "This peer; the value is always 1.",
                                 labels=["peer_id", "run_name", "version"])
        if status.get("peer_id"):
            info.add_metric([str(status["peer_id"]), str(status.get("run_name", "")),
                             str(status.get("software_version", ""))], 1.0)
        yield info
        yield _gauge("peerd_uptime_seconds", "Seconds since this daemon started.", _number(status, "uptime"))
        peers = status.get("peers")
        seen = float(len(peers)) if isinstance(peers, list) and not status.get("dht_error") else None
        yield _gauge("peerd_swarm_peers", "Other peers with a live record in the DHT (absent if the read "
                     "failed).", seen)
        view = _mapping(status, "view") or {}
        partial = view.get("partial")
        yield _gauge("peerd_swarm_view_partial", "1 while this peer's view of the swarm looks partial (split "
                     "brain?), see peerd.swarm.view.", None if partial is None else float(bool(partial)))
        yield _counter("peerd_swarm_rebootstraps", "Re-bootstraps after a partial view.",
                       _number(view, "rebootstraps"))
        dropped = CounterMetricFamily("peerd_records_dropped", "DHT records refused (forged, foreign or "
                                      "malformed), by reason.", labels=["reason"])
        yield _by_label(dropped, _mapping(status, "records_dropped"))
        yield from self._membership(_mapping(status, "membership"))
        yield from self._reachability(_mapping(status, "reachability"))

    def _membership(self, m: Mapping[str, Any] | None) -> Iterator[Metric]:
        refused = CounterMetricFamily("peerd_streams_refused", "Inbound streams refused before any payload was "
                                      "read (not a member, bad proof, busy, malformed handshake), by reason.",
                                      labels=["reason"])
        yield _by_label(refused, _mapping(m, "streams_refused"))
        yield _counter("peerd_streams_accepted", "Inbound streams that passed the membership handshake.",
                       _number(m, "streams_accepted"))
        yield _gauge("peerd_streams_open", "Inbound peerd streams open now.", _number(m, "streams_open"))
        yield _gauge("peerd_streams_pending_bytes", "Bytes of inbound frames being received now (bounded by "
                     "swarm.streams).", _number(m, "pending_bytes"))

    def _reachability(self, r: Mapping[str, Any] | None) -> Iterator[Metric]:
        state = GaugeMetricFamily("peerd_reachability", "How other peers reach this one (the current state has "
                                  "value 1): public, direct, relayed or unreachable.", labels=["state"])
        if r is not None and r.get("state"):
            state.add_metric([str(r["state"])], 1.0)
        yield state
        connections = GaugeMetricFamily("peerd_connections", "Open connections to other peers, by path.",
                                        labels=["via"])
        yield _by_label(connections, _mapping(r, "connections"))
        service = _mapping(r, "relay_service")
        yield _counter("peerd_relay_bytes", "Bytes this peer's relay service carried for others.",
                       _number(service, "bytes_relayed"))
        yield _counter("peerd_relay_circuits", "Relayed connections this peer carried for others.",
                       _number(service, "circuits_total"))
        yield _gauge("peerd_relay_circuits_open", "Relayed connections open through this peer now.",
                     _number(service, "circuits_open"))
        yield _gauge("peerd_relay_reservations", "Peers holding a relay slot on this peer now.",
                     _number(service, "reservations_open"))

    def _training(self, t: Mapping[str, Any] | None) -> Iterator[Metric]:
        for name, key, doc in _TRAINING_GAUGES:
            yield _gauge(name, doc, _number(t, key))
        averaging = _mapping(t, "averaging")
        stalled = averaging.get("stalled") if averaging is not None else None
        yield _gauge("peerd_averaging_stalled", "1 while rounds keep ending without averaging although other "
                     "trainers are in view (this peer trains alone), else 0.",
                     float(stalled) if isinstance(stalled, bool) else None)
        yield _gauge("peerd_averaging_failed_streak", "Rounds in a row that ended without averaging while other "
                     "trainers were in view.", _number(averaging, "failed_streak"))
        yield _counter("peerd_training_compute_seconds", "Seconds spent in forward, backward and inner "
                       "optimizer steps.", _number(t, "compute_seconds"))
        yield _counter("peerd_training_state_syncs", "Times this peer downloaded the training state from "
                       "a peer.", _number(t, "state_syncs"))
        rounds = CounterMetricFamily("peerd_averaging_rounds", "Global steps by outcome: averaged in a group "
                                     "(ok) or taken alone because no group formed (solo).", labels=["result"])
        for label, key in (("ok", "rounds_ok"), ("solo", "rounds_solo")):
            if (value := _number(t, key)) is not None:
                rounds.add_metric([label], value)
        yield rounds
        last = _mapping(t, "last_round")
        yield _gauge("peerd_averaging_group_size", "Members of the last averaging group.",
                     _number(last, "group_size"))
        yield _gauge("peerd_averaging_codec_error_ratio", "Relative L2 error of the 8-bit codec in the last "
                     "round.", _number(last, "codec_error"))
        excluded = _mapping(last, "excluded")
        yield _gauge("peerd_averaging_excluded_peers", "Peers left out of the last round.",
                     float(len(excluded)) if excluded is not None else None)
        yield _histogram("peerd_averaging_round_duration_seconds", "Duration of averaging rounds.",
                         _mapping(t, "round_durations"), ROUND_DURATION_BUCKETS)
        sent = CounterMetricFamily("peerd_sent_bytes", "Payload bytes sent to peers, by kind.",
                                   labels=["kind"])
        received = CounterMetricFamily("peerd_received_bytes", "Payload bytes received from peers, by kind.",
                                       labels=["kind"])
        traffic = _mapping(t, "traffic") or {}
        for kind in traffic:
            entry = _mapping(traffic, kind)
            if (value := _number(entry, "sent")) is not None:
                sent.add_metric([str(kind)], value)
            if (value := _number(entry, "received")) is not None:
                received.add_metric([str(kind)], value)
        yield sent
        yield received

    def _experts(self, experts: Mapping[str, Any] | None) -> Iterator[Metric]:
        yield _counter("peerd_expert_calls", "Expert forward/backward calls served or made by this daemon.",
                       _number(experts, "calls") or 0.0)
        yield _counter("peerd_expert_call_errors", "Expert calls that failed.",
                       _number(experts, "errors") or 0.0)
        yield _histogram("peerd_expert_call_duration_seconds", "Latency of expert calls.",
                         _mapping(experts, "latency"), EXPERT_CALL_BUCKETS)

    def _processes(self) -> Iterator[Metric]:
        rss = GaugeMetricFamily("peerd_process_resident_memory_bytes", "Resident memory of the daemon "
                                "process and of all its descendants (the DHT process and p2pd).",
                                labels=["process"])
        cpu = CounterMetricFamily("peerd_process_cpu_seconds", "User and system CPU time of the daemon "
                                  "process and of all its live descendants.", labels=["process"])
        children: list[psutil.Process] = []
        try:
            rss.add_metric(["daemon"], float(self._process.memory_info().rss))
            times = self._process.cpu_times()
            cpu.add_metric(["daemon"], times.user + times.system)
            children = self._process.children(recursive=True)
        except psutil.Error:
            pass
        child_rss = child_cpu = 0.0
        alive = 0
        for child in children:
            try:  # a child may exit between listing and reading it
                child_rss += child.memory_info().rss
                times = child.cpu_times()
                child_cpu += times.user + times.system
                alive += 1
            except psutil.Error:
                continue
        rss.add_metric(["children"], child_rss)
        cpu.add_metric(["children"], child_cpu)
        yield rss
        yield cpu
        yield _gauge("peerd_process_children", "Live descendant processes of the daemon.", float(alive))


class DaemonMetrics:
    """One daemon's registry. ``render(snapshot)`` returns the Prometheus text exposition of that snapshot."""

    def __init__(self, process: psutil.Process | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = StatusCollector(process)
        self.registry.register(self._collector)

    def render(self, snapshot: Mapping[str, Any]) -> bytes:
        # No await between setting and reading the snapshot, so concurrent scrapes cannot mix snapshots.
        self._collector.snapshot = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self._collector.snapshot = {}

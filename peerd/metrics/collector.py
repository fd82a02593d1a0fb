"""The Prometheus collector of one daemon: metric families read from its status snapshot and its process tree."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from peerd.metrics.families import (
    EXPERT_CALL_BUCKETS,
    ROUND_DURATION_BUCKETS,
    by_label,
    counter,
    gauge,
    histogram,
    mapping,
    number,
)

__all__ = ["DaemonMetrics", "StatusCollector"]

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


class StatusCollector(Collector):
    """Turns one status snapshot plus the process tree into metric families."""

    def __init__(self, process: psutil.Process | None = None) -> None:
        self.snapshot: Mapping[str, Any] = {}
        self._process = process or psutil.Process()

    def collect(self) -> Iterator[Metric]:
        status = self.snapshot
        yield from self._identity(status)
        yield from self._training(mapping(status, "training"))
        yield from self._experts(mapping(status, "experts"))
        yield from self._processes()

    def _identity(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        info = GaugeMetricFamily("peerd_info", "This peer; the value is always 1.",
                                 labels=["peer_id", "run_name", "version"])
        if status.get("peer_id"):
            info.add_metric([str(status["peer_id"]), str(status.get("run_name", "")),
                             str(status.get("software_version", ""))], 1.0)
        yield info
        yield gauge("peerd_uptime_seconds", "Seconds since this daemon started.", number(status, "uptime"))
        peers = status.get("peers")
        seen = float(len(peers)) if isinstance(peers, list) and not status.get("dht_error") else None
        yield gauge("peerd_swarm_peers", "Other peers with a live record in the DHT (absent if the read "
                    "failed).", seen)
        view = mapping(status, "view") or {}
        partial = view.get("partial")
        yield gauge("peerd_swarm_view_partial", "1 while this peer's view of the swarm looks partial (split "
                    "brain?), see peerd.swarm.view.", None if partial is None else float(bool(partial)))
        yield counter("peerd_swarm_rebootstraps", "Re-bootstraps after a partial view.",
                      number(view, "rebootstraps"))
        dropped = CounterMetricFamily("peerd_records_dropped", "DHT records refused (forged, foreign or "
                                      "malformed), by reason.", labels=["reason"])
        yield by_label(dropped, mapping(status, "records_dropped"))
        yield counter("peerd_dht_requests_cut", "DHT requests cut short by the wait bound, or answered too late to "
                      "count (swarm.dht_wait_ratio).", number(status, "dht_requests_cut"))
        yield counter("peerd_dht_peers_kept_out", "Times a DHT node that proved no membership was kept out of "
                      "this peer's routing table (private swarms).", number(status, "dht_peers_kept_out"))
        yield counter("peerd_dht_requests_refused", "DHT finds and stores refused for asking about more keys at "
                      "once than their sender may, or for a whole dictionary from a peer not yet admitted.",
                      number(status, "dht_requests_refused"))
        yield from self._membership(mapping(status, "membership"))
        yield from self._reachability(mapping(status, "reachability"))

    def _membership(self, m: Mapping[str, Any] | None) -> Iterator[Metric]:
        refused = CounterMetricFamily("peerd_streams_refused", "Inbound streams refused before any payload was "
                                      "read (not a member, bad proof, busy, malformed handshake), by reason.",
                                      labels=["reason"])
        yield by_label(refused, mapping(m, "streams_refused"))
        yield counter("peerd_streams_accepted", "Inbound streams that passed the membership handshake.",
                      number(m, "streams_accepted"))
        yield counter("peerd_peers_disconnected", "Peers that had not proven membership, disconnected for failing "
                      "a handshake or opening streams past their pool (swarm.streams.disconnect_unproven).",
                      number(m, "peers_disconnected"))
        yield gauge("peerd_streams_open", "Inbound peerd streams open now.", number(m, "streams_open"))
        yield gauge("peerd_streams_pending_bytes", "Bytes of inbound frames being received now (bounded by "
                    "swarm.streams).", number(m, "pending_bytes"))

    def _reachability(self, r: Mapping[str, Any] | None) -> Iterator[Metric]:
        state = GaugeMetricFamily("peerd_reachability", "How other peers reach this one (the current state has "
                                  "value 1): public, direct, relayed or unreachable.", labels=["state"])
        if r is not None and r.get("state"):
            state.add_metric([str(r["state"])], 1.0)
        yield state
        connections = GaugeMetricFamily("peerd_connections", "Open connections to other peers, by path.",
                                        labels=["via"])
        yield by_label(connections, mapping(r, "connections"))
        service = mapping(r, "relay_service")
        yield counter("peerd_relay_bytes", "Bytes this peer's relay service carried for others.",
                      number(service, "bytes_relayed"))
        yield counter("peerd_relay_circuits", "Relayed connections this peer carried for others.",
                      number(service, "circuits_total"))
        yield gauge("peerd_relay_circuits_open", "Relayed connections open through this peer now.",
                    number(service, "circuits_open"))
        yield gauge("peerd_relay_reservations", "Peers holding a relay slot on this peer now.",
                    number(service, "reservations_open"))

    def _training(self, t: Mapping[str, Any] | None) -> Iterator[Metric]:
        for name, key, doc in _TRAINING_GAUGES:
            yield gauge(name, doc, number(t, key))
        averaging = mapping(t, "averaging")
        stalled = averaging.get("stalled") if averaging is not None else None
        yield gauge("peerd_averaging_stalled", "1 while rounds keep ending without averaging although other "
                    "trainers are in view (this peer trains alone), else 0.",
                    float(stalled) if isinstance(stalled, bool) else None)
        yield gauge("peerd_averaging_failed_streak", "Rounds in a row that ended without averaging while other "
                    "trainers were in view.", number(averaging, "failed_streak"))
        yield counter("peerd_training_compute_seconds", "Seconds spent in forward, backward and inner "
                      "optimizer steps.", number(t, "compute_seconds"))
        yield counter("peerd_training_state_syncs", "Times this peer downloaded the training state from "
                      "a peer.", number(t, "state_syncs"))
        rounds = CounterMetricFamily("peerd_averaging_rounds", "Global steps by outcome: averaged in a group "
                                     "(ok) or taken alone because no group formed (solo).", labels=["result"])
        for label, key in (("ok", "rounds_ok"), ("solo", "rounds_solo")):
            if (value := number(t, key)) is not None:
                rounds.add_metric([label], value)
        yield rounds
        last = mapping(t, "last_round")
        yield gauge("peerd_averaging_group_size", "Members of the last averaging group.",
                    number(last, "group_size"))
        yield gauge("peerd_averaging_codec_error_ratio", "Relative L2 error of the codec in the last round.",
                    number(last, "codec_error"))
        yield from self._codec(t, last)
        excluded = mapping(last, "excluded")
        yield gauge("peerd_averaging_excluded_peers", "Peers left out of the last round.",
                    float(len(excluded)) if excluded is not None else None)
        yield histogram("peerd_averaging_round_duration_seconds", "Duration of averaging rounds.",
                        mapping(t, "round_durations"), ROUND_DURATION_BUCKETS)
        sent = CounterMetricFamily("peerd_sent_bytes", "Payload bytes sent to peers, by kind.",
                                   labels=["kind"])
        received = CounterMetricFamily("peerd_received_bytes", "Payload bytes received from peers, by kind.",
                                       labels=["kind"])
        traffic = mapping(t, "traffic") or {}
        for kind in traffic:
            entry = mapping(traffic, kind)
            if (value := number(entry, "sent")) is not None:
                sent.add_metric([str(kind)], value)
            if (value := number(entry, "received")) is not None:
                received.add_metric([str(kind)], value)
        yield sent
        yield received

    def _codec(self, t: Mapping[str, Any] | None, last: Mapping[str, Any] | None) -> Iterator[Metric]:
        info = GaugeMetricFamily("peerd_averaging_codec_info", "How this peer codes what it averages (value 1): "
                                 "averaging.codec.scheme and what encodes 8-bit blocks (the C kernel's "
                                 "instruction set, or torch).", labels=["scheme", "kernel"])
        if t is not None and t.get("codec_scheme"):
            info.add_metric([str(t["codec_scheme"]), str(t.get("codec_kernel", ""))], 1.0)
        yield info
        yield gauge("peerd_averaging_codec_density", "topk: the share of a payload's elements that travel.",
                    number(t, "codec_density"))
        yield gauge("peerd_averaging_codec_value_bits", "topk: bits per sent value.", number(t, "codec_value_bits"))
        yield gauge("peerd_averaging_round_sent_bytes", "Payload bytes this peer sent in the last gradient or "
                    "pseudo-gradient round.", number(last, "bytes_sent"))
        yield gauge("peerd_averaging_round_received_bytes", "Payload bytes this peer received in the last "
                    "gradient or pseudo-gradient round.", number(last, "bytes_received"))

    def _experts(self, experts: Mapping[str, Any] | None) -> Iterator[Metric]:
        yield counter("peerd_expert_calls", "Expert forward/backward calls served or made by this daemon.",
                      number(experts, "calls") or 0.0)
        yield counter("peerd_expert_call_errors", "Expert calls that failed.",
                      number(experts, "errors") or 0.0)
        yield histogram("peerd_expert_call_duration_seconds", "Latency of expert calls.",
                        mapping(experts, "latency"), EXPERT_CALL_BUCKETS)

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
        yield gauge("peerd_process_children", "Live descendant processes of the daemon.", float(alive))


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

"""Prometheus metrics of one daemon, rendered at scrape time from the snapshot ``GET /status`` returns.

Nothing here counts events as they happen. A custom collector reads the daemon's status snapshot (the
mapping `peerd status --json` prints; its ``training`` part is ``TrainingReport.as_dict()``) and this
process tree's memory and CPU through psutil. So every daemon has its own registry, there is no global
state, and this floor-1 package imports nothing from training or averaging. :class:`Distribution` is the
one thing components record into: a fixed-bucket histogram kept in their own reports and exposed here as
a Prometheus histogram.

Snapshot keys read (all optional; a missing value gives a family without samples, never a made-up zero):
``peer_id``, ``run_name``, ``software_version``, ``uptime``, ``peers`` (absent when ``dht_error`` is set),
``records_dropped`` (reason -> count), ``dht_requests_cut``, ``dht_peers_kept_out``, ``dht_requests_refused``,
``membership`` (``streams_refused``: reason -> count, ``streams_accepted``, ``peers_disconnected``, ``streams_open``,
``pending_bytes``), ``reachability``
(``state``, ``connections``, ``relay_service``: ``bytes_relayed``, ``circuits_total``, ``circuits_open``,
``reservations_open``), ``training`` (see ``TrainingReport.as_dict``) and ``experts`` (``calls``, ``errors``,
``latency``, reported once this daemon hosts or calls experts; until then those families hold zeros, which is
what happened).
"""

from peerd.metrics.collector import DaemonMetrics, StatusCollector
from peerd.metrics.families import CONTENT_TYPE, EXPERT_CALL_BUCKETS, ROUND_DURATION_BUCKETS, Distribution

__all__ = ["CONTENT_TYPE", "EXPERT_CALL_BUCKETS", "ROUND_DURATION_BUCKETS", "DaemonMetrics", "Distribution",
           "StatusCollector"]

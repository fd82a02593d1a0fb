"""What a trainer reports to logs, `peerd status` and metrics: a plain, read-only-by-convention snapshot.

Besides the current values it keeps bounded history for the status page's curves: one point per global
step (the mean of that step's micro-batch losses), one per validation, and the last averaging rounds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from peerd.averaging.group import RoundReport
from peerd.metrics import ROUND_DURATION_BUCKETS, Distribution
from peerd.training.health import AveragingHealth

LOSS_HISTORY = 2000
CURVE_POINTS = 1000  # per-step points kept for the loss curves
ROUND_HISTORY = 20


@dataclass
class TrainingReport:
    fingerprint: str
    parameters: int  # trainable: what rounds average
    model_parameters: int = 0  # all of them, frozen ones (a LoRA run's base model) included
    tokens_per_sample: int | None = None  # language-model tasks: tokens per sequence
    mode: str = "sync"
    device: str = "cpu"
    compute_threads: int = 0  # torch threads of the thread that runs the model (peerd/threads.py)
    codec_kernel: str = ""  # what encodes 8-bit payloads: the C kernel's instruction set, or torch
    codec_scheme: str = ""  # averaging.codec.scheme: how averaged gradients and pseudo-gradients are coded
    codec_density: float | None = None  # topk: the share of elements a payload carries
    codec_value_bits: int | None = None  # topk: bits per sent value
    precision: str = "fp32"
    state: str = "starting"
    step: int = 0
    loss: float | None = None  # exponential moving average of micro-batch losses
    validation_loss: float | None = None
    validation_step: int | None = None
    samples_per_second: float = 0.0  # while computing (the window's samples over its compute seconds)
    swarm_samples_per_second: float = 0.0
    samples_trained: int = 0  # by this peer, since it started
    peers_training: int = 0
    rounds_ok: int = 0
    rounds_solo: int = 0
    health: AveragingHealth = field(default_factory=AveragingHealth)  # are the rounds still averaging?
    group_sizes: dict[int, int] = field(default_factory=dict)  # gradient rounds by group size
    state_syncs: int = 0
    state_sync_failures: int = 0  # attempts to load a vouched state that no donor could satisfy
    steps_refused: int = 0  # updates not applied: they would have made the model non-finite
    # diloco: inner steps taken in the current phase, and whether the last phase's outer round is in flight
    inner_steps: int = 0
    outer_pending: bool = False
    # seconds in forward, backward and (diloco) inner optimizer steps, and since the first of them
    compute_seconds: float = 0.0
    _first_compute: float | None = None
    _stopped: float | None = None
    # the state transfers' live progress (downloads as a joiner, serving as a donor), read when reporting
    transfers: Callable[[], dict[str, Any]] | None = None
    # peers this one excludes from averaging, and why (the all-reduce's ban list), read when reporting
    bans: Callable[[], dict[str, Any]] | None = None
    # members that kept a round of this one's waiting, watched in its rounds (averaging.absences), read likewise
    absences: Callable[[], dict[str, Any]] | None = None
    # what this trainer believes of the others' claims (peerd.training.joining), read when reporting
    claims: Callable[[], dict[str, Any]] | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    last_round: dict[str, Any] | None = None
    foreign_peers: dict[str, str] = field(default_factory=dict)
    clipped_peers: dict[str, int] = field(default_factory=dict)  # peer id -> rounds our span clipped/capped it
    losses: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=LOSS_HISTORY))
    curve: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=CURVE_POINTS))
    validations: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=CURVE_POINTS))
    rounds: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=ROUND_HISTORY))
    round_durations: Distribution = field(default_factory=lambda: Distribution(ROUND_DURATION_BUCKETS))
    # kind -> payload bytes; gradients from the start, so its series exists (at 0) before the first round
    traffic: dict[str, dict[str, int]] = field(
        default_factory=lambda: {"gradients": {"sent": 0, "received": 0}}
    )
    _window: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=50))
    _open_step: tuple[int, float, int, float] | None = None  # step, loss sum, micro-batches, last time

    def record_loss(self, loss: float, samples: int, seconds: float) -> None:
        current = time.time()
        self.samples_trained += samples
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        self.losses.append((current, self.step, loss))
        if self._open_step is not None and self._open_step[0] != self.step:
            self.curve.append(self._curve_point(self._open_step))
            self._open_step = None
        step, total, count, _ = self._open_step or (self.step, 0.0, 0, current)
        self._open_step = (step, total + loss, count + 1, current)
        self._window.append((seconds, samples))
        busy = sum(s for s, _ in self._window)
        self.samples_per_second = sum(n for _, n in self._window) / busy if busy > 0 else 0.0
        self._note_validation()

    def record_compute(self, seconds: float) -> None:
        """Adds time spent computing (forward, backward, inner step): the numerator of utilisation."""
        if self._first_compute is None:
            self._first_compute = time.monotonic() - seconds
        self.compute_seconds += seconds

    def stop_clock(self) -> None:
        """Training is over (max_steps): wall_seconds, and with it utilisation, stop growing."""
        self._stopped = time.monotonic()

    @property
    def wall_seconds(self) -> float:
        end = self._stopped if self._stopped is not None else time.monotonic()
        return end - self._first_compute if self._first_compute is not None else 0.0

    def record_round(self, report: RoundReport, samples: int | None = None) -> None:
        """``samples``: what this peer contributed to the round (its weight in the average)."""
        self.rounds_ok += 1
        self.health.averaged()
        self.group_sizes[report.group_size] = self.group_sizes.get(report.group_size, 0) + 1
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.record_traffic("gradients", report.bytes_sent, report.bytes_received)
        self.record_traffic("checks", report.check_bytes_sent, report.check_bytes_received)
        self.round_durations.observe(report.duration)
        for peer in report.clipped:
            self.clipped_peers[peer] = self.clipped_peers.get(peer, 0) + 1
        self.last_round = {
            "step": self.step,
            "group_size": report.group_size,
            "samples": samples,
            "duration": round(report.duration, 3),
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "check_bytes_sent": report.check_bytes_sent,  # the verification's, beside the averaging payload
            "codec_error": report.codec_error,
            "excluded": dict(report.excluded),
            "aggregation": report.aggregation,
            # contributions to this peer's span that the robust rule clipped or weight-capped, by peer id
            "clipped": {peer: asdict(note) for peer, note in report.clipped.items()},
            # spans whose averages did not check out (this peer kept its own values there), and who lied
            "unverified": {str(span): reason for span, reason in report.unverified.items()},
            "accused": dict(report.accused),
        }
        self.rounds.append({"time": round(time.time(), 3), **self.last_round})
        self._note_validation()

    def record_solo(self, error: str, others: int) -> None:
        """A round that ended without averaging; ``others``: other trainers in view (0: nobody to average with)."""
        self.rounds_solo += 1
        if others > 0:
            self.health.failed(error, others)
        else:
            self.health.alone()

    def record_traffic(self, kind: str, sent: int, received: int) -> None:
        """Adds payload bytes exchanged with peers under ``kind`` (gradients, state, ...) for metrics."""
        entry = self.traffic.setdefault(kind, {"sent": 0, "received": 0})
        entry["sent"] += sent
        entry["received"] += received

    def _note_validation(self) -> None:
        # The trainer assigns validation_loss and validation_step directly (no await in between), so a new
        # validation shows up as a new step here; picking it up lazily keeps the trainer free of history code.
        if self.validation_loss is None or self.validation_step is None:
            return
        if not self.validations or self.validations[-1][1] != self.validation_step:
            self.validations.append((time.time(), self.validation_step, self.validation_loss))

    @staticmethod
    def _curve_point(open_step: tuple[int, float, int, float]) -> tuple[float, int, float]:
        step, total, count, last = open_step
        return last, step, total / count

    def history(self, points: int = CURVE_POINTS) -> dict[str, Any]:
        """The last ``points`` per-step losses (the current step's running mean last) and validation losses,
        each as ``[unix time, step, loss]``, and the last averaging rounds, oldest first."""
        self._note_validation()
        curve = list(self.curve)
        if self._open_step is not None:
            curve.append(self._curve_point(self._open_step))
        validations = list(self.validations)
        return {
            "loss": [[round(t, 3), step, loss] for t, step, loss in curve[-points:]],
            "validation_loss": [[round(t, 3), step, loss] for t, step, loss in validations[-points:]],
            "rounds": list(self.rounds),
        }

    def round_bytes(self) -> dict[str, int] | None:
        """Bytes this peer's last gradient round moved (sent and received), and what the same round would move
        if every parameter trained: the saving of training only some of them (LoRA adapters)."""
        if self.last_round is None or not self.parameters:
            return None
        moved = int(self.last_round["bytes_sent"]) + int(self.last_round["bytes_received"])
        full = moved * max(self.model_parameters, self.parameters) // self.parameters
        return {"trainable": moved, "all_parameters": full}

    def as_dict(self) -> dict[str, Any]:
        tokens = self.tokens_per_sample
        return {
            "fingerprint": self.fingerprint,
            "parameters": self.parameters,
            "model_parameters": self.model_parameters or self.parameters,
            "round_bytes": self.round_bytes(),
            "tokens_per_second": round(self.samples_per_second * tokens, 1) if tokens else None,
            "mode": self.mode,
            "device": self.device,
            "compute_threads": self.compute_threads,
            "codec_kernel": self.codec_kernel,
            "codec_scheme": self.codec_scheme,
            "codec_density": self.codec_density,
            "codec_value_bits": self.codec_value_bits,
            "precision": self.precision,
            "state": self.state,
            "step": self.step,
            # diloco: step is the outer step (the phase); inner_steps counts this phase's local steps so far
            "phase": self.step if self.mode == "diloco" else None,
            "inner_steps": self.inner_steps,
            "outer_pending": self.outer_pending,
            "compute_seconds": round(self.compute_seconds, 3),
            "wall_seconds": round(self.wall_seconds, 3),
            "utilisation": round(self.compute_seconds / self.wall_seconds, 4) if self.wall_seconds > 0 else None,
            "loss": self.loss,
            "validation_loss": self.validation_loss,
            "validation_step": self.validation_step,
            "samples_per_second": round(self.samples_per_second, 2),
            "samples_trained": self.samples_trained,
            "swarm_samples_per_second": round(self.swarm_samples_per_second, 2),
            "peers_training": self.peers_training,
            "rounds_ok": self.rounds_ok,
            "rounds_solo": self.rounds_solo,
            "averaging": self.health.as_dict(),
            "group_sizes": {str(size): count for size, count in sorted(self.group_sizes.items())},
            "state_syncs": self.state_syncs,
            "state_sync_failures": self.state_sync_failures,
            "steps_refused": self.steps_refused,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_round": self.last_round,
            "foreign_peers": self.foreign_peers,
            "clipped_peers": dict(self.clipped_peers),
            "traffic": {kind: dict(entry) for kind, entry in self.traffic.items()},
            "round_durations": self.round_durations.as_dict(),
            "state_transfer": self.transfers() if self.transfers is not None else None,
            "banned_peers": self.bans() if self.bans is not None else {},
            "watched_peers": self.absences() if self.absences is not None else {},
            "claims": self.claims() if self.claims is not None else None,
        }

"""State transfer for late joiners, the joiner's side: download a donor's state into tensors allocated from our
own template, resuming with the next donor where the last one stopped.

The manifest is checked on its own terms and against our :data:`Template` and ``max_bytes`` before any payload
is read; the payload lands in tensors of our template's sizes (about one copy of the state in memory, no
blob); every frame must have exactly the length the manifest implies. A donor that sends nothing for
``stall_timeout`` seconds is dropped for the next candidate, which is asked to continue from the same byte if
it holds the same step and layout, and otherwise starts over. The state is checked with
:func:`~peerd.training.state.check_state` before it is returned.

A donor that announces its tensors' digests (:mod:`.digest`) is checked tensor by tensor as each completes,
and an ``accept`` callback decides from the manifest's step and root whether the state is one to load at all.
Each tensor then comes whole from one donor (a download that switches donors restarts the current tensor), so
a tensor that does not match its digest proves its one donor lied: it goes to :class:`~peerd.training.distrust.
Distrust`, which the downloader consults before asking anyone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from peerd.errors import ProtocolViolation, StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.distrust import Distrust
from peerd.training.state import Template, TrainingState, check_state
from peerd.training.transfer.manifest import (
    HANDLER_NAME,
    PROTOCOL_VERSION,
    STALL_TIMEOUT,
    Manifest,
    byte_view,
    check_against_template,
    check_manifest,
    chunks,
    manifest_limit,
    nbytes,
)
from peerd.training.transfer.probe import read_response
from peerd.wire.frames import read_frame_into, write_message
from peerd.wire.guard import StreamGuard

__all__ = ["Accept", "StateDownloader"]

logger = logging.getLogger(__name__)

ROUNDS = 3  # passes over the candidates (the first given, the others refreshed) before giving up
RETRY_DELAY = 2.0  # seconds between passes: every donor may have been busy

Refresh = Callable[[], Awaitable[Sequence[str]]]
# Given a checked manifest and its donor: None to download it, else why not (the donor is skipped, not accused).
Accept = Callable[[Manifest, str], Awaitable[str | None]]
EMPTY_DIGEST = hashlib.sha256().digest()


class _Lie(StateError):
    """A donor sent bytes that do not match the digest it announced for them."""


class StateDownloader:
    def __init__(self, guard: StreamGuard, fingerprint: str, template: Template, max_bytes: int, *,
                 stall_timeout: float = STALL_TIMEOUT, rounds: int = ROUNDS, retry_delay: float = RETRY_DELAY,
                 distrust: Distrust | None = None) -> None:
        """``distrust``: donors not to ask, and where a donor caught lying is reported."""
        self.guard = guard
        self.distrust = distrust if distrust is not None else Distrust()
        self.fingerprint = fingerprint
        self.template = template
        self.max_bytes = max_bytes
        self.stall_timeout = stall_timeout
        self.rounds = rounds
        self.retry_delay = retry_delay
        self.state = "idle"
        self.donor: str | None = None
        self.donors_tried = 0
        self.bytes_from: dict[str, int] = {}  # payload bytes received from each donor in the current download
        self._began: float | None = None
        self._ended: float | None = None
        self._buffers: dict[str, torch.Tensor] | None = None
        self._manifest: Manifest | None = None
        self._position = (0, 0)  # (tensor index in the manifest, offset): the first byte not yet held
        self._done = 0
        self._logged_tenth = 0  # tenths of the state reported in the log so far
        self._tried: dict[str, None] = {}  # donors of the current download, in order
        self._accept: Accept | None = None
        self._into: Callable[[], dict[str, torch.Tensor]] | None = None
        self._hash = hashlib.sha256()  # of the current tensor's bytes so far, with digests
        self._total = sum(nbytes(shape, dtype) for shape, dtype in template.values())

    def status(self) -> dict[str, Any]:
        """Progress of the current (or last) download, for the status endpoint."""
        end = self._ended if self._ended is not None else time.monotonic()
        return {
            "state": self.state, "donor": self.donor,
            "step": self._manifest.step if self._manifest is not None else None,
            "bytes_done": self._done, "bytes_total": self._total,
            "donors_tried": self.donors_tried, "bytes_from": dict(self.bytes_from),
            "seconds": round(end - self._began, 3) if self._began is not None else 0.0,
        }

    async def download(self, candidates: Sequence[str], refresh: Refresh | None = None, min_step: int = 0,
                       accept: Accept | None = None,
                       into: Callable[[], dict[str, torch.Tensor]] | None = None) -> TrainingState:
        """The state of a donor among ``candidates`` (tried in order, excluded donors skipped) at step
        ``min_step`` or later, checked against the template. ``accept``: only manifests with digests it accepts,
        each tensor checked against its digest. ``into``: makes the tensors (of the template's names and
        sizes) to download into, instead of fresh ones. When all fail, ``refresh`` gives the next candidates,
        up to ``rounds`` passes; then StateError lists what each donor did."""
        self.state, self.donor, self.donors_tried, self.bytes_from = "downloading", None, 0, {}
        self._tried, self._accept, self._into = {}, accept, into
        self._began, self._ended = time.monotonic(), None
        self._manifest, self._position, self._done = None, (0, 0), 0
        self._logged_tenth = 0
        problems: list[str] = []
        try:
            for round_ in range(self.rounds):
                if round_ > 0:
                    if refresh is None:
                        break
                    await asyncio.sleep(self.retry_delay)
                    candidates = await refresh()
                for peer in candidates:
                    if self.distrust.excluded(peer):
                        problems.append(f"{peer} is excluded: it served a state that was not what it announced")
                        continue
                    state = await self._try(peer, min_step, problems)
                    if state is not None:
                        self.state = "done"
                        return state
            raise StateError("no peer could provide its training state:\n  " + "\n  ".join(problems or ["none"]),
                             source=", ".join(self._tried) or "no candidates")
        finally:
            self._ended = time.monotonic()
            self._buffers = None  # the caller owns the returned tensors; a failed download's are dropped
            if self.state != "done":
                self.state = "failed"

    async def _try(self, peer: str, min_step: int, problems: list[str]) -> TrainingState | None:
        self.donor = peer
        self.donors_tried += 1
        self._tried[peer] = None
        try:
            await self._fetch(peer, min_step)
        except _Lie as e:
            problems.append(str(e))
            self.distrust.accuse(peer, str(e))
        except TimeoutError:
            problems.append(f"{peer} sent nothing for {self.stall_timeout:.0f}s")
        except (StateError, ProtocolViolation) as e:
            problems.append(str(e))  # names the peer
        except Exception as e:  # noqa: BLE001 - a network boundary: hivemind's ControlFailure, MembershipError, ...
            problems.append(f"{peer}: {type(e).__name__}: {e}")
        else:
            assert self._manifest is not None and self._buffers is not None  # _fetch completed a transfer
            tensors = {name: self._buffers[name] for name in self._manifest.names}
            state = TrainingState(self._manifest.step, tensors, self._manifest.digests)
            donors = ", ".join(self.bytes_from)
            try:
                await asyncio.to_thread(check_state, state, self.template, f"state from {donors}")
            except StateError as e:
                problems.append(str(e))
                self._restart()
                logger.warning("State download: %s", e)
                return None
            seconds = time.monotonic() - (self._began or 0.0)
            logger.info("Downloaded the training state at step %d (%d bytes) from %s in %.1fs (%.1f Mbit/s)",
                        state.step, self._done, donors, seconds, self._done * 8 / 1e6 / max(seconds, 1e-6))
            return state
        if self._manifest is not None and self._manifest.digests is not None:
            index, offset = self._position  # a tensor comes whole from one donor: the next starts it over
            self._position, self._done = (index, 0), self._done - offset
        logger.warning("State download failed (%d of %d bytes held): %s", self._done, self._total, problems[-1])
        return None

    def _restart(self) -> None:
        self._position, self._done, self._logged_tenth = (0, 0), 0, 0

    async def _fetch(self, peer: str, min_step: int) -> None:
        """One donor: request (with our resume point, if any), manifest, payload into our buffers."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.stall_timeout) as stall:
            reader, writer = await self.guard.open(peer, HANDLER_NAME)
            try:
                request = pb.StateRequest(protocol_version=PROTOCOL_VERSION, fingerprint=self.fingerprint)
                resume = self._resume_point()
                if resume is not None:
                    request.resume.CopyFrom(resume)
                await write_message(writer, request)
                response = await read_response(reader, peer, manifest_limit(self.template))
                manifest = check_manifest(response, peer, self.max_bytes)
                check_against_template(manifest, self.template, peer)
                if manifest.step < min_step:
                    raise StateError(f"{peer} offers step {manifest.step}; this peer needs {min_step} or later",
                                     source=peer)
                await self._check_acceptable(manifest, peer)
                self._begin(manifest, resume, peer)
                views = [byte_view(self._buffer(name)) for name in manifest.names]
                for index, offset, length in chunks(manifest.sizes, manifest.start, manifest.chunk_bytes):

                    def arrived(size: int, index: int = index) -> None:
                        stall.reschedule(loop.time() + self.stall_timeout)
                        self._done += size
                        self.bytes_from[peer] += size
                        self._position = (index, self._position[1] + size)

                    frame = views[index][offset : offset + length]
                    await read_frame_into(reader, frame, peer, f"chunk of tensor {manifest.names[index]}", arrived)
                    if manifest.digests is not None:
                        self._verify(manifest, index, offset, frame, peer)
                    self._advance()
                    self._log_progress(peer)
            finally:
                writer.close()

    async def _check_acceptable(self, manifest: Manifest, peer: str) -> None:
        if self._accept is None:
            return
        if manifest.digests is None:
            raise StateError(f"{peer} announces no digests of its state: nothing to check it against", source=peer)
        reason = await self._accept(manifest, peer)
        if reason is not None:
            raise StateError(f"{peer} offers a state of step {manifest.step} that is not loaded: {reason}",
                             source=peer)
        for name, size, digest in zip(manifest.names, manifest.sizes, manifest.digests, strict=True):
            if size == 0 and digest != EMPTY_DIGEST:
                raise _Lie(f"{peer} announced a digest of empty tensor {name} that is not the empty one",
                           source=peer)

    def _verify(self, manifest: Manifest, index: int, offset: int, frame: memoryview, peer: str) -> None:
        """Hashes a frame of a tensor this donor sends whole; at the tensor's end, compares with its digest."""
        assert manifest.digests is not None
        if offset == 0:
            self._hash = hashlib.sha256()
        self._hash.update(frame)
        if offset + len(frame) == manifest.sizes[index] and self._hash.digest() != manifest.digests[index]:
            raise _Lie(f"{peer} sent tensor {manifest.names[index]} of step {manifest.step} whose bytes do not "
                       "match the digest it announced for them", source=peer)

    def _log_progress(self, peer: str) -> None:
        """One line per tenth of the state: a long download on a slow link shows that it moves, and where."""
        tenth = self._done * 10 // max(self._total, 1)
        if tenth > self._logged_tenth:
            self._logged_tenth = tenth
            logger.info("State download progress %d/%d bytes from %s", self._done, self._total, peer)

    def _resume_point(self) -> pb.ResumePoint | None:
        if self._manifest is None or self._done == 0:
            return None
        index, offset = self._position  # with digests, a failure has moved it back to a tensor's start
        return pb.ResumePoint(step=self._manifest.step, layout=self._manifest.digest, tensor=index, offset=offset)

    def _begin(self, manifest: Manifest, resume: pb.ResumePoint | None, peer: str) -> None:
        """Adopts a checked manifest: continues where we stopped if the donor says so, else starts over."""
        self.bytes_from.setdefault(peer, 0)
        if manifest.start != (0, 0):
            asked = (resume.tensor, resume.offset) if resume is not None else None
            if (self._manifest is None or manifest.start != asked or manifest.step != self._manifest.step
                    or manifest.digest != self._manifest.digest):
                raise ProtocolViolation(f"{peer} sends state from tensor {manifest.start[0]}, offset "
                                        f"{manifest.start[1]}, which this peer did not ask for", peer_id=peer)
            logger.info("Resuming the state download of step %d from %s at byte %d of %d", manifest.step, peer,
                        self._done, manifest.total_bytes)
        else:
            if self._done:
                assert self._manifest is not None
                logger.info("%s serves step %d (this peer held %d bytes of step %d): restarting from zero", peer,
                            manifest.step, self._done, self._manifest.step)
            self._restart()
        self._manifest = manifest
        self._advance()

    def _buffer(self, name: str) -> torch.Tensor:
        if self._buffers is None:  # sized by our own template, never by what a donor announced
            if self._into is not None:
                self._buffers = self._into()
            else:
                self._buffers = {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in self.template.items()}
        return self._buffers[name]

    def _advance(self) -> None:
        """Moves the position past complete (and empty) tensors, so it names the first byte still missing."""
        assert self._manifest is not None
        index, offset = self._position
        sizes = self._manifest.sizes
        while index < len(sizes) and offset >= sizes[index]:
            index, offset = index + 1, 0
        self._position = (index, offset)

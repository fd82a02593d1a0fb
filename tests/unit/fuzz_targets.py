"""Every decoder a peer's bytes reach, as fuzz targets shared by tests/unit/test_fuzz.py (CI-sized) and
benchmarks/fuzz_decoders.py (>= 100,000 cases each).

A target is a hypothesis strategy of inputs and a function that feeds one input to the decoder. The property
is the same for all: the decoder returns a valid value (checked by the function) or raises one of the
target's documented errors, never anything else, never hangs, and never allocates memory for a length or
shape it was only told about. Inputs are arbitrary bytes or values, plus (finding far more) valid inputs
with structured mutations: bit flips, boundary integers written over length and shape fields, truncation,
insertion, splicing, and record fields replaced by arbitrary values.
"""

from __future__ import annotations

import asyncio
import io
import math
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError, Message
from hivemind.proto import crypto_pb2
from hypothesis import strategies as st
from pydantic import ValidationError

from peerd.averaging.decisions import Entry, decision_problem
from peerd.averaging.group import Group
from peerd.averaging.requests import SpanView, check_request
from peerd.config import CodecConfig
from peerd.errors import CodecError, MembershipError, ProtocolViolation, StateError
from peerd.experts.calls import max_payload_bytes
from peerd.experts.records import parse_host_record
from peerd.experts.server.backend import ExpertBackend
from peerd.experts.server.headers import check_header, oversized_payload
from peerd.proto import peerd_averaging_pb2 as apb
from peerd.proto import peerd_experts_pb2 as epb
from peerd.proto import peerd_membership_pb2 as mpb
from peerd.proto import peerd_training_pb2 as tpb
from peerd.swarm.records import parse_record
from peerd.swarm.signing import RecordLifetimes, RecordSigner, RecordVerifier, key_id
from peerd.training.checkpoint import load_state, save_state
from peerd.training.progress import ProgressRecord
from peerd.training.state import TrainingState, template_of
from peerd.training.transfer.download import StateDownloader
from peerd.training.transfer.manifest import (
    byte_view,
    check_against_template,
    check_manifest,
    chunks,
    encode_manifest,
)
from peerd.wire import codec, handshake
from peerd.wire.frames import MAX_HEADER_BYTES, read_frame, read_frame_into, read_frame_or_eof, read_message
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership

PID = "12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"
PID2 = "12D3KooWRtaQXj9DZCijkmMe1B81YDiREjvqc4BgNZ8639FNP12S"
# Integers that sit on the edges decoders compare against: signedness, 32/64-bit wrap, sizes near limits.
BOUNDARY_INTS = [0, 1, 2, 7, 8, 127, 128, 255, 256, 1023, 1024, 65535, 65536, 2**20, 2**31 - 1, 2**31, 2**32 - 1,
                 2**32, 2**40, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@dataclass(frozen=True)
class Target:
    name: str
    inputs: st.SearchStrategy[Any]
    run: Callable[[Any], object]
    errors: tuple[type[BaseException], ...]  # what the decoder documents; anything else is a crash


# --- byte mutations -------------------------------------------------------------------------------------------


def _mutate(data: bytearray, op: str, where: float, value: int, blob: bytes) -> None:
    at = min(len(data), int(where * (len(data) + 1)))
    if op == "flip" and data:
        data[min(at, len(data) - 1)] ^= 1 << (value % 8)
    elif op == "byte" and data:
        data[min(at, len(data) - 1)] = value % 256
    elif op in ("u64", "u32", "u16"):
        width = {"u64": 8, "u32": 4, "u16": 2}[op]
        if len(data) >= width:
            start = min(at, len(data) - width) // width * width  # aligned: where codec and frame fields sit
            data[start : start + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    elif op == "truncate":
        del data[at:]
    elif op == "insert":
        data[at:at] = blob
    elif op == "delete":
        del data[at : at + 1 + value % 64]
    elif op == "splice":
        data[at:at] = bytes(data[: value % (len(data) + 1)])


@st.composite
def mutated(draw: st.DrawFn, seeds: st.SearchStrategy[bytes], max_ops: int = 4) -> bytes:
    """A valid input with up to ``max_ops`` mutations (none at all for a share of the cases)."""
    data = bytearray(draw(seeds))
    for _ in range(draw(st.integers(0, max_ops))):
        op = draw(st.sampled_from(["flip", "byte", "u64", "u32", "u16", "truncate", "insert", "delete", "splice"]))
        value = draw(st.sampled_from(BOUNDARY_INTS) | st.integers(0, 2**64 - 1))
        _mutate(data, op, draw(st.floats(0, 1)), value, draw(st.binary(max_size=16)))
    return bytes(data)


def byte_inputs(seeds: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.binary(max_size=512) | mutated(seeds)


# --- frames ---------------------------------------------------------------------------------------------------


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def _reader(data: bytes) -> asyncio.StreamReader:
    # bound to the fuzzing loop explicitly: outside a running loop, StreamReader() asks for the current one,
    # which an earlier test's asyncio.run() may have unset
    reader = asyncio.StreamReader(loop=_loop())
    reader.feed_data(data)
    reader.feed_eof()
    return reader


_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP


def run_async(coro: Any, timeout: float = 5.0) -> Any:
    """Runs ``coro`` on one event loop kept for all cases (a loop per case costs more than most decoders);
    a coroutine still waiting after ``timeout`` with all its input and EOF delivered is a hang."""
    return _loop().run_until_complete(asyncio.wait_for(coro, timeout))


def _frames(case: tuple[int, int, bytes]) -> object:
    kind, limit, data = case
    reader = _reader(data)
    if kind == 0:
        got = run_async(read_frame(reader, limit, PID, "fuzz frame"))
        assert isinstance(got, bytes) and len(got) <= limit
    elif kind == 1:
        got = run_async(read_frame_or_eof(reader, limit, PID, "fuzz frame"))
        assert got is None and not data or isinstance(got, bytes) and len(got) <= limit
    elif kind == 2:
        got = run_async(read_message(reader, epb.ExpertRequest, PID))
        assert isinstance(got, epb.ExpertRequest)
    else:  # a state chunk read into a buffer of the size the joiner expects
        into = bytearray(b"\xaa" * min(limit, 64))
        run_async(read_frame_into(reader, memoryview(into), PID, "fuzz chunk"))
        got = bytes(into)
        assert data[:8] == len(into).to_bytes(8, "little") and got == data[8 : 8 + len(into)]
    return got


FRAME_SEEDS = st.lists(st.binary(max_size=64), min_size=1, max_size=3).map(lambda parts: b"".join(map(frame, parts)))
FRAMES = Target(
    "frames",
    st.tuples(st.integers(0, 3), st.sampled_from([0, 1, 64, MAX_HEADER_BYTES, 2**40, 2**64]),
              byte_inputs(FRAME_SEEDS)),
    _frames,
    (ProtocolViolation,),
)


# --- protobuf headers and their validators ----------------------------------------------------------------------

u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
small_or_huge = st.sampled_from(BOUNDARY_INTS).filter(lambda v: v < 2**32) | st.integers(0, 300)


def _messages(*strategies: st.SearchStrategy[Message]) -> st.SearchStrategy[bytes]:
    return st.one_of(*strategies).map(lambda m: m.SerializeToString())


SPAN = SpanView(Group("run/fp/1/abc", (PID, PID2)), PID2, rank=1, numel=1000, chunk_numel=256)


def _averaging(data: bytes) -> object:
    apb.ReduceResponse.FromString(data)  # the sender's side reads these
    request = apb.ReduceRequest.FromString(data)
    verdict = check_request(SPAN, PID, request, set())
    if verdict is None:  # served: everything the reducer then relies on holds
        assert request.span_index == SPAN.rank and request.span_numel == SPAN.numel
        assert request.chunk_numel == SPAN.chunk_numel and math.isfinite(request.weight) and request.weight > 0
    else:
        assert verdict[0] in apb.MessageCode.values()
    return verdict


AVERAGING_SEEDS = _messages(
    st.builds(apb.ReduceRequest, protocol_version=st.sampled_from([1]) | u32, round_id=st.text(max_size=40),
              span_index=st.sampled_from([1]) | u32, span_numel=st.sampled_from([1000]) | u64,
              weight=st.floats(allow_nan=True, allow_infinity=True), chunk_numel=st.sampled_from([256]) | u64),
    st.builds(apb.ReduceResponse, code=st.integers(0, 9), message=st.text(max_size=40), chunk_index=u32,
              contributors=u32, total_weight=st.floats(), included=st.booleans()),
)
AVERAGING = Target("averaging-header", byte_inputs(AVERAGING_SEEDS), _averaging, (DecodeError,))


def _state_manifest(data: bytes) -> object:
    """What a donor's first answer goes through before a byte of payload: decode, checks, our template."""
    tpb.StateRequest.FromString(data)  # the donor's side reads these
    manifest = check_manifest(tpb.StateResponse.FromString(data), PID, max_bytes=1 << 20)
    check_against_template(manifest, STATE_TEMPLATE, PID)
    assert manifest.layout == STATE_TEMPLATE and manifest.total_bytes == STATE.nbytes
    assert manifest.start == (0, 0) or manifest.start[1] < manifest.sizes[manifest.start[0]]
    return manifest


@st.composite
def state_manifests(draw: st.DrawFn) -> tpb.StateResponse:
    """Our manifest with fields (its own and its tensors') replaced by boundary or arbitrary values."""
    response = encode_manifest(STATE, draw(st.sampled_from([4096, 1 << 20]) | u32))
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(["step", "protocol_version", "total_bytes", "chunk_bytes", "start_tensor",
                                      "start_offset", "code", "name", "dtype", "shape", "nbytes", "drop", "add"]))
        info = response.tensors[draw(st.integers(0, len(response.tensors) - 1))]
        number = draw(st.sampled_from(BOUNDARY_INTS) | st.integers(0, 300))
        if field in ("protocol_version", "chunk_bytes", "start_tensor", "code", "dtype"):
            setattr(info if field == "dtype" else response, field, number % 2**31 if field in ("code", "dtype")
                    else number % 2**32)
        elif field in ("step", "total_bytes", "start_offset"):
            setattr(response, field, number % 2**64)
        elif field == "nbytes":
            info.nbytes = number % 2**64
        elif field == "name":
            info.name = draw(st.sampled_from(list(STATE.tensors)) | st.text(max_size=12))
        elif field == "shape":
            info.shape[:] = draw(st.lists(st.sampled_from(BOUNDARY_INTS) | st.integers(0, 8), max_size=9))
        elif field == "drop" and len(response.tensors) > 1:
            del response.tensors[0]
        elif field == "add":
            response.tensors.add().CopyFrom(info)
    return response


STATE_MANIFEST_SEEDS = _messages(
    state_manifests(),
    st.builds(tpb.StateRequest, protocol_version=u32, fingerprint=st.text(max_size=70), manifest_only=st.booleans(),
              resume=st.builds(tpb.ResumePoint, step=u64, layout=st.binary(max_size=40), tensor=u32, offset=u64)),
)


# --- training state: the joiner's whole download, and checkpoint files -------------------------------------------

FINGERPRINT = "0123abcd"
STATE = TrainingState(7, {
    "model/0.weight": torch.randn(3000, generator=torch.Generator().manual_seed(0)),  # 3 chunks of 4096 bytes
    "model/0.bias": torch.ones(3, dtype=torch.bfloat16),
    "inner/0/step": torch.tensor(2.0),
    "outer/mask": torch.tensor([True, False]),
    "outer/empty": torch.empty(0, 2),
    "outer/count": torch.tensor([3], dtype=torch.int64),
})
STATE_TEMPLATE = template_of(STATE)


def donor_stream(response: tpb.StateResponse) -> bytes:
    """What a donor sends for ``response``: the manifest, then the payload frames its fields imply (as far as
    they make sense: a fuzzed manifest gets our state's bytes, cut as it says)."""
    views = [byte_view(t) for t in STATE.tensors.values()]
    sizes = tuple(len(v) for v in views)
    chunk = min(max(response.chunk_bytes, 1), 1 << 16)
    start = (response.start_tensor, response.start_offset) if response.start_tensor < len(sizes) else (0, 0)
    payload = [bytes(views[i][at : at + length]) for i, at, length in chunks(sizes, start, chunk)]
    return b"".join(map(frame, [response.SerializeToString(), *payload]))


VALID_STREAM = donor_stream(encode_manifest(STATE, 4096))


class _DonorGuard:
    """StreamGuard.open for a donor that has already said everything in ``data``."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def open(self, peer: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return _reader(self.data), cast(asyncio.StreamWriter, _Writer())


def _state_download(data: bytes) -> object:
    downloader = StateDownloader(cast(StreamGuard, _DonorGuard(data)), FINGERPRINT, STATE_TEMPLATE, 1 << 20,
                                 stall_timeout=5.0, rounds=1)
    # one donor's fetch, so that an error it does not document surfaces here instead of in the download's log
    run_async(downloader._fetch(PID, 0))
    status = downloader.status()
    assert status["bytes_done"] == STATE.nbytes and status["bytes_from"] == {PID: STATE.nbytes}
    state = run_async(downloader.download([PID]))  # the same bytes again: now through the final check
    assert state.step >= 0 and template_of(state) == STATE_TEMPLATE
    return state


STATE_DOWNLOAD = Target(
    "state-download",
    st.binary(max_size=256) | mutated(st.just(VALID_STREAM)) | state_manifests().map(donor_stream)
    | mutated(state_manifests().map(donor_stream), max_ops=2),
    _state_download,
    (StateError, ProtocolViolation),
)
STATE_MANIFEST = Target(
    "state-manifest",
    byte_inputs(STATE_MANIFEST_SEEDS) | state_manifests().map(lambda m: m.SerializeToString()),
    _state_manifest,
    (DecodeError, ProtocolViolation, StateError),
)


def _state_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state.pt"
        save_state(path, STATE, FINGERPRINT)
        return path.read_bytes()


VALID_STATE_FILE = _state_file_bytes()


# --- expert requests: header, its checks, then the payload decode the batch queue does ---------------------------

HIDDEN = 8
MAX_TOKENS = 64
EXPERT_UID = "ffn.0.0"
_BACKENDS = cast(dict[str, ExpertBackend], {EXPERT_UID: SimpleNamespace(hidden_dim=HIDDEN)})


def _expert_call(case: tuple[bytes, bytes]) -> object:
    """What the host does with a call: header, its checks, payload frames read at the announced sizes, decode."""
    header, stream = case
    epb.ExpertResponse.FromString(header)  # the caller's side reads these
    request = epb.ExpertRequest.FromString(header)
    problem = check_header(request, _BACKENDS, MAX_TOKENS) or oversized_payload(request, MAX_TOKENS)
    if problem is not None:
        assert problem.code in (epb.EXPERT_BAD_REQUEST, epb.EXPERT_UNKNOWN) and problem.message
        return problem
    # what the host reads into memory for an accepted header is bounded by the shape it accepted
    assert all(size <= max_payload_bytes(request.num_tokens, HIDDEN) for size in request.payload_bytes)
    reader = _reader(stream)
    payloads = [run_async(read_frame(reader, size, PID, "expert payload")) for size in request.payload_bytes]
    shape = (request.num_tokens, HIDDEN)
    tensors = [codec.decode(p, peer_id=PID, expected_shape=shape).float() for p in payloads]
    assert all(t.shape == shape and bool(torch.isfinite(t).all()) for t in tensors)
    return tensors


def _expert_payload(tokens: int, lossless: bool) -> bytes:
    config = CodecConfig(lossless=True) if lossless else CodecConfig(min_compress_numel=2**62, error_feedback=False)
    return bytes(codec.encode(torch.randn(tokens, HIDDEN), config))


@st.composite
def expert_calls(draw: st.DrawFn) -> tuple[bytes, bytes]:
    tokens = draw(st.integers(1, 8) | st.sampled_from(BOUNDARY_INTS).filter(lambda v: v < 2**32))
    backward = draw(st.booleans())
    call_id = draw(st.sampled_from([0, 0, 1]) | u64)
    count = 2 if backward and not call_id else 1
    real_tokens = min(tokens, 8)
    payloads = [draw(mutated(st.just(_expert_payload(real_tokens, draw(st.booleans()))), max_ops=2))
                for _ in range(count)]
    declared = draw(st.just([len(p) for p in payloads]) | st.lists(small_or_huge | u64, max_size=3))
    header = epb.ExpertRequest(
        protocol_version=draw(st.sampled_from([2]) | u32), expert_uid=draw(st.sampled_from([EXPERT_UID]) | st.text(max_size=20)),
        phase=draw(st.sampled_from([1, 2]) | st.integers(0, 5)), num_tokens=tokens,
        hidden_dim=draw(st.sampled_from([HIDDEN]) | u32), payload_bytes=declared, lossless=draw(st.booleans()),
        call_id=call_id,
    ).SerializeToString()
    return draw(mutated(st.just(header), max_ops=2)), b"".join(map(frame, payloads))


EXPERT_REQUEST = Target(
    "expert-request",
    expert_calls() | st.tuples(st.binary(max_size=128), st.binary(max_size=256)),
    _expert_call,
    (DecodeError, CodecError, ProtocolViolation),
)


# --- codec payloads ---------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def codec_payloads(draw: st.DrawFn) -> bytes:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 1000)))).to(dtype)
    config = draw(st.sampled_from([
        CodecConfig(lossless=True), CodecConfig(min_compress_numel=0, block_size=8),
        CodecConfig(min_compress_numel=0, block_size=16), CodecConfig(min_compress_numel=2**62),
        CodecConfig(min_compress_numel=0, block_size=8, scheme="blockwise4"),
        CodecConfig(min_compress_numel=0, block_size=8, scheme="blockwise2"),
        CodecConfig(min_compress_numel=0, block_size=8, scheme="topk", density=0.2, value_bits=2),
        CodecConfig(min_compress_numel=0, block_size=8, scheme="topk", density=0.05, value_bits=8),
        None,  # SPARSE8: an average's largest elements, as a reducer returns an average of top-k rows
    ]))
    scaled = values * draw(st.sampled_from([1.0, 1e-6, 1e4]))
    if config is None:
        scaled[torch.rand(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 1000)))) < 0.7] = 0
        return bytes(codec.encode_largest(scaled, 8, draw(st.integers(0, 1000))))
    return bytes(codec.encode(scaled, config))


def _header_shape(data: bytes) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The dtype and shape a payload claims, if small enough to allocate an ``out`` for."""
    if len(data) < codec.HEADER.size:
        return None
    _, _, _, dtype_code, ndim, _, _, numel = codec.HEADER.unpack_from(data)
    if dtype_code > 2 or ndim > 4 or numel > 4096 or len(data) < codec.HEADER.size + 8 * ndim:
        return None
    shape = struct.unpack_from(f"<{ndim}Q", data, codec.HEADER.size)
    if math.prod(shape) != numel or max(shape, default=0) > 4096:
        return None
    return DTYPES[dtype_code], shape


def _codec(case: tuple[bytes, int, int | None]) -> object:
    data, mode, max_numel = case
    claimed = _header_shape(data)
    out = expected = None
    if mode == 1 and claimed is not None:
        out = torch.full(claimed[1], 7.0, dtype=claimed[0])
    elif mode == 2 and claimed is not None:
        expected = claimed[1]
    elif mode == 3:
        expected = (3, 5)
    try:
        result = codec.decode(data, peer_id=PID, expected_shape=expected, max_numel=max_numel, out=out)
    except CodecError:
        assert out is None or bool((out == 7.0).all()), "a refused payload changed out="
        raise
    # a decoded tensor is backed by the bytes received (at most 16 output bytes per input byte: four 2-bit codes
    # -> fp32), or, for a sparse payload, bounded by the shape or limit the caller expected
    bounded = expected is not None or out is not None or max_numel is not None
    assert result.numel() * result.element_size() <= 16 * len(data) or bounded
    assert result.numel() == 0 or bool(torch.isfinite(result.float()).all())
    assert out is None or result is out
    assert expected is None or tuple(result.shape) == tuple(expected)
    assert max_numel is None or result.numel() <= max_numel
    return result


CODEC = Target(
    "codec",
    st.tuples(byte_inputs(codec_payloads()), st.integers(0, 3), st.none() | st.sampled_from([0, 16, 10**6])),
    _codec,
    (CodecError,),
)


# --- DHT records (what msgpack delivers: nested dicts, lists, strings, bytes, numbers) ---------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=40)
            | st.binary(max_size=40) | st.sampled_from([PID, PID2, f"/ip4/127.0.0.1/tcp/1/p2p/{PID}", "ffn.0.1"]))
values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


@st.composite
def record_like(draw: st.DrawFn, valid: dict[str, Any]) -> object:
    """``valid`` with some fields replaced by arbitrary values, removed, or joined by unknown ones."""
    record = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid)), max_size=3)):
        if draw(st.booleans()):
            record[key] = draw(values)
        else:
            record.pop(key, None)
    record.update(draw(st.dictionaries(st.text(max_size=8), values, max_size=2)))
    return record


def records_of(valid: dict[str, Any]) -> st.SearchStrategy[object]:
    return values | record_like(valid)


PEER_RECORD_VALID = {
    "peer_id": PID, "software_version": "0.1.0", "protocol_version": 1, "roles": ["trainer"], "state": "idle",
    "maddrs": [f"/ip4/127.0.0.1/tcp/4000/p2p/{PID}"], "capabilities": {"experts": ["ffn.0.1"], "throughput": 1.5},
    "started_at": 100.0, "updated_at": 105.0,
}
PEER_RECORD = Target(
    "peer-record",
    st.tuples(st.sampled_from([PID, PID2, "groups"]) | values, records_of(PEER_RECORD_VALID)),
    lambda case: parse_record(*case),
    (ProtocolViolation,),
)

PROGRESS_VALID = {"peer_id": PID, "fingerprint": "0123abcd", "step": 3, "samples": 10, "samples_per_second": 2.5,
                  "time": 100.0, "shard": 1}
PROGRESS_RECORD = Target(
    "progress-record", records_of(PROGRESS_VALID), ProgressRecord.model_validate, (ValidationError,)
)


def _matchmaking(case: tuple[bool, object]) -> object:
    _, value = case
    entry = Entry.model_validate(value)
    assert math.isfinite(entry.t) and entry.t >= 0
    assert entry.groups is None or all(1 <= len(g) <= 64 for g in entry.groups)
    if entry.groups is not None:  # the reader's check of a decision, on whatever it claims
        decision_problem(entry.groups, {PID: 1.0, PID2: 2.0}, {PID: entry.apart}, 4, 2)
    return entry


MATCHMAKING = Target(
    "matchmaking-entry",
    st.tuples(st.booleans(), records_of({"peer_id": PID, "t": 12.5})
              | records_of({"peer_id": PID, "t": 12.5, "groups": [[PID, PID2]]})),
    _matchmaking,
    (ValidationError,),
)

EXPERT_RECORD_VALID = {
    "peer_id": PID, "maddrs": [f"/ip4/127.0.0.1/tcp/4000/p2p/{PID}"], "protocol_version": 2, "hidden_dim": 64,
    "module": "ffn", "uids": ["ffn.0.1", "ffn.0.2"], "updates": [4, 5], "started_at": 100.0, "updated_at": 105.0,
}
EXPERT_RECORD = Target(
    "expert-record",
    st.tuples(st.sampled_from([PID, PID2]) | values, records_of(EXPERT_RECORD_VALID)),
    lambda case: parse_host_record(*case),
    (ProtocolViolation,),
)


_state_values = values | st.builds(
    lambda shape, fill: torch.full(shape, fill),
    st.lists(st.integers(0, 3), max_size=2).map(tuple), st.floats(width=32),
)


@st.composite
def state_files(draw: st.DrawFn) -> bytes:
    """A valid checkpoint file with parts of its dict replaced (tensors included), saved with torch.save."""
    state = torch.load(io.BytesIO(VALID_STATE_FILE), weights_only=True)
    for _ in range(draw(st.integers(1, 3))):
        node: Any = state
        path = []
        while isinstance(node, dict) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node, key=str)))
            path.append(key)
            node = node[key]
        if not path:
            continue
        parent = state
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = draw(_state_values)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _state_file(blob: bytes) -> object:
    state = load_state(io.BytesIO(blob), STATE_TEMPLATE, FINGERPRINT, source="fuzz")
    assert type(state.step) is int and template_of(state) == STATE_TEMPLATE
    return state


STATE_FILE = Target(
    "state-file",
    st.binary(max_size=256) | mutated(st.just(VALID_STATE_FILE)) | state_files(),
    _state_file,
    (StateError,),
)


# --- membership handshake ---------------------------------------------------------------------------------------


class _Writer:
    """Collects what a handshake writes; the fuzzer has already scripted everything the other side says."""

    # write_frames asks the transport whether it is closing or full; this one keeps everything and is neither
    transport = SimpleNamespace(is_closing=lambda: False, get_write_buffer_limits=lambda: (0, 0),
                                get_write_buffer_size=lambda: 0)

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, parts: list[bytes]) -> None:
        for part in parts:
            self.data += part

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


MEMBERSHIPS = [Membership(), Membership(secret=b"k" * 32), Membership(allowlist=frozenset({PID}))]


def _handshake(case: tuple[bool, int, bytes]) -> object:
    initiating, which, data = case
    side = handshake.initiate if initiating else handshake.accept
    writer = cast(asyncio.StreamWriter, _Writer())
    run_async(side(_reader(data), writer, MEMBERSHIPS[which], PID2, PID, "peerd.v1.fuzz"))
    return True


HANDSHAKE_SEEDS = st.one_of(
    st.tuples(  # what a responder says: a Challenge, then a Verdict
        st.builds(mpb.Challenge, version=st.sampled_from([1]) | u32, code=st.integers(0, 8),
                  message=st.text(max_size=20), nonce=st.binary(min_size=32, max_size=32) | st.binary(max_size=40),
                  proof=st.binary(max_size=40)),
        st.builds(mpb.Verdict, code=st.integers(0, 8), message=st.text(max_size=20)),
    ).map(lambda ms: b"".join(frame(m.SerializeToString()) for m in ms)),
    st.tuples(  # what an initiator says: a Hello, then a Proof
        st.builds(mpb.Hello, version=st.sampled_from([1]) | u32,
                  nonce=st.binary(min_size=32, max_size=32) | st.binary(max_size=40), has_secret=st.booleans()),
        st.builds(mpb.Proof, proof=st.binary(max_size=40)),
    ).map(lambda ms: b"".join(frame(m.SerializeToString()) for m in ms)),
)
HANDSHAKE = Target(
    "handshake",
    st.tuples(st.booleans(), st.integers(0, len(MEMBERSHIPS) - 1), byte_inputs(HANDSHAKE_SEEDS)),
    _handshake,
    (ProtocolViolation, MembershipError),
)


# --- signed DHT envelopes (peerd.swarm.signing), opened before any record above is parsed ---------------------


def _identity() -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
SIGNERS = [RecordSigner(_identity(), membership) for membership in MEMBERSHIPS[:2]]
VERIFIERS = [RecordVerifier(membership, RecordLifetimes(default=2.0**41), clock=lambda: 0.0) for membership in MEMBERSHIPS]
RECORD_KEY = "peerd-fuzz.peers"
KEY_ID = key_id(RECORD_KEY)


def _envelope(signer: RecordSigner, payload: dict[str, Any], expiration: float) -> tuple[str, object, float]:
    payload = {**payload, "peer_id": signer.peer_id}
    return signer.peer_id, signer.envelope(RECORD_KEY, signer.peer_id, payload, expiration), expiration


def _signed_record(case: tuple[int, tuple[object, object, object]]) -> object:
    which, (subkey, value, expiration) = case
    if not isinstance(subkey, str) or not isinstance(expiration, float):
        return None  # the DHT validator refuses these before opening (a non-text subkey) or hivemind's types do
    opened = VERIFIERS[which].open(KEY_ID, subkey, value, expiration)
    assert isinstance(opened.payload, dict) and opened.payload.get("peer_id") == opened.signer
    return opened


SIGNED_SEEDS = st.builds(
    _envelope, st.sampled_from(SIGNERS), st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    st.floats(0, 2**40, allow_nan=False),
)
SIGNED_RECORD = Target(
    "signed-record",
    st.tuples(st.integers(0, len(VERIFIERS) - 1),
              SIGNED_SEEDS | st.tuples(st.text(max_size=60) | values, values | record_like(
                  {"p": b"{}", "k": b"", "s": b"", "t": b"", "e": 1.0}), st.floats())),
    _signed_record,
    (ProtocolViolation,),
)

TARGETS = [FRAMES, AVERAGING, STATE_MANIFEST, STATE_DOWNLOAD, EXPERT_REQUEST, CODEC, PEER_RECORD, PROGRESS_RECORD,
           MATCHMAKING, EXPERT_RECORD, STATE_FILE, HANDSHAKE, SIGNED_RECORD]

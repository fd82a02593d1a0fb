"""The manifest of a training-state transfer: what a donor announces before any payload, and the checks a
joiner runs on it (every field comes from a peer and is hostile until checked) before it allocates or reads
a byte of payload. Pure functions, fuzzed in tests/unit/fuzz_targets.py."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from peerd.errors import ProtocolViolation, StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.state import Template, TrainingState
from peerd.training.transfer.digest import DIGEST_BYTES, root_digest

HANDLER_NAME = "peerd.v1.training.state"
PROTOCOL_VERSION = 3
CHUNK_BYTES = 1 << 20
# A donor that sends nothing (and a joiner that reads nothing) for this long is given up on; a transfer as a
# whole has no deadline, since its length grows with the state and shrinks with the link.
STALL_TIMEOUT = 30.0
DTYPES: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.DTYPE_FLOAT32, torch.float16: pb.DTYPE_FLOAT16, torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64, torch.int32: pb.DTYPE_INT32, torch.uint8: pb.DTYPE_UINT8, torch.bool: pb.DTYPE_BOOL,
}
TORCH_DTYPES = {code: dtype for dtype, code in DTYPES.items()}
MAX_NAME = 200
NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
MAX_DIMS = 8
MAX_TENSORS = 16384
# A manifest frame read without a template of ours to size it (a probe): 16384 entries of the longest name.
MAX_MANIFEST_BYTES = 8 << 20
MIN_CHUNK, MAX_CHUNK = 4 << 10, 8 << 20


@dataclass(frozen=True)
class Manifest:
    """A checked StateResponse with code STATE_OK."""

    step: int
    names: tuple[str, ...]  # transfer order
    layout: Template  # name -> (shape, dtype), in transfer order
    sizes: tuple[int, ...]  # bytes of each tensor, in transfer order
    chunk_bytes: int
    start: tuple[int, int]  # (tensor index, offset) of the first payload byte
    digests: tuple[bytes, ...] | None = None  # sha256 of each tensor's bytes, if the donor announced them

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def root(self) -> bytes | None:
        """What members vouch for (:func:`~peerd.training.transfer.digest.root_digest`); None without digests."""
        return root_digest(self.step, self.layout, self.digests) if self.digests is not None else None

    @property
    def digest(self) -> bytes:
        """What a resume point names: the root if the donor announced digests (a donor with other contents
        under the same layout restarts the joiner from zero), else the layout's digest."""
        root = self.root
        return root if root is not None else layout_digest(self.layout)

    def offset_of(self, position: tuple[int, int]) -> int:
        """Bytes of the state before ``position`` (a tensor index and an offset in it)."""
        return sum(self.sizes[: position[0]]) + position[1]


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as they travel (writable when the tensor is)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def layout_digest(layout: Template) -> bytes:
    """Identifies names, dtypes and shapes in order: two manifests with the same digest cut their payload into
    the same byte ranges, so a download can resume from one donor to the other."""
    h = hashlib.sha256()
    for name, (shape, dtype) in layout.items():
        h.update(f"{name}\0{DTYPES.get(dtype, 0)}\0{','.join(map(str, shape))}\n".encode())
    return h.digest()


def resume_key(state: TrainingState) -> bytes:
    """What a joiner's resume point must name to continue a download of ``state``: :attr:`Manifest.digest`."""
    layout = {name: (tuple(t.shape), t.dtype) for name, t in state.tensors.items()}
    if state.digests is not None:
        return root_digest(state.step, layout, state.digests)
    return layout_digest(layout)


def encode_manifest(state: TrainingState, chunk_bytes: int, start: tuple[int, int] = (0, 0)) -> pb.StateResponse:
    """Our own state's manifest, with its tensors' digests if the state has them; ValueError if it holds what
    the protocol cannot carry (a dtype, a name)."""
    tensors = []
    if not 0 < len(state.tensors) <= MAX_TENSORS:
        raise ValueError(f"a state of {len(state.tensors)} tensors cannot be sent (1 to {MAX_TENSORS})")
    digests = state.digests
    if digests is not None and (len(digests) != len(state.tensors) or any(len(d) != DIGEST_BYTES for d in digests)):
        raise ValueError(f"a state of {len(state.tensors)} tensors needs as many {DIGEST_BYTES}-byte digests")
    for i, (name, tensor) in enumerate(state.tensors.items()):
        if tensor.dtype not in DTYPES or not NAME.fullmatch(name) or tensor.dim() > MAX_DIMS:
            raise ValueError(f"tensor {name[:80]!r} ({tensor.dtype}, {tensor.dim()} dims) cannot be sent: the "
                             f"protocol carries {sorted(map(str, DTYPES))}, names matching {NAME.pattern} and at "
                             f"most {MAX_DIMS} dims")
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
            raise ValueError(f"tensor {name} is not a dense, contiguous CPU tensor")
        tensors.append(pb.TensorInfo(name=name, dtype=DTYPES[tensor.dtype], shape=tensor.shape,
                                     nbytes=tensor.numel() * tensor.element_size(),
                                     sha256=digests[i] if digests is not None else b""))
    return pb.StateResponse(
        code=pb.STATE_OK, step=state.step, protocol_version=PROTOCOL_VERSION, tensors=tensors,
        total_bytes=sum(t.nbytes for t in tensors), chunk_bytes=chunk_bytes, start_tensor=start[0],
        start_offset=start[1],
    )


def manifest_limit(template: Template) -> int:
    """The largest manifest frame a donor of ``template``'s state can send: ours with every number at its
    widest (a varint of at most 10 bytes)."""
    fields = sum(len(name.encode()) + 16 + 11 * (len(shape) + 3) + 2 + DIGEST_BYTES
                 for name, (shape, _) in template.items())
    return min(MAX_MANIFEST_BYTES, fields + 1024)


def check_manifest(response: pb.StateResponse, peer: str, max_bytes: int) -> Manifest:
    """Checks every field of a donor's STATE_OK answer on its own terms; ProtocolViolation naming ``peer``
    on anything inconsistent, StateError if the state is larger than ``max_bytes``."""

    def bad(what: str) -> ProtocolViolation:
        return ProtocolViolation(f"{peer} sent an invalid state manifest: {what}", peer_id=peer)

    if response.protocol_version != PROTOCOL_VERSION:
        raise bad(f"protocol version {response.protocol_version}, this peerd speaks {PROTOCOL_VERSION}")
    if not 0 < len(response.tensors) <= MAX_TENSORS:
        raise bad(f"{len(response.tensors)} tensors (1 to {MAX_TENSORS} allowed)")
    if response.step >= 2**63:
        raise bad(f"step {response.step}")
    if not MIN_CHUNK <= response.chunk_bytes <= MAX_CHUNK:
        raise bad(f"chunk size {response.chunk_bytes} (from {MIN_CHUNK} to {MAX_CHUNK} allowed)")
    if response.total_bytes > max_bytes:  # before the per-tensor work: a cheap refusal of an oversized state
        raise StateError(f"{peer} offers {response.total_bytes} bytes of state, above training.max_state_bytes "
                         f"({max_bytes})", source=peer)
    layout: Template = {}
    sizes = []
    total = 0
    announced = {len(info.sha256) for info in response.tensors}
    if announced not in ({0}, {DIGEST_BYTES}):
        raise bad(f"tensor digests of {sorted(announced)} bytes (all {DIGEST_BYTES}, or none)")
    for info in response.tensors:
        name = info.name
        if not NAME.fullmatch(name):
            raise bad(f"tensor name {name[:MAX_NAME]!r} (names match {NAME.pattern})")
        if name in layout:
            raise bad(f"tensor {name} listed twice")
        if info.dtype not in TORCH_DTYPES:
            raise bad(f"tensor {name} has dtype code {info.dtype}")
        if len(info.shape) > MAX_DIMS:
            raise bad(f"tensor {name} has {len(info.shape)} dims (at most {MAX_DIMS})")
        shape = tuple(int(d) for d in info.shape)
        dtype = TORCH_DTYPES[info.dtype]
        size = nbytes(shape, dtype)  # exact: Python integers do not overflow
        if size != info.nbytes:
            raise bad(f"tensor {name} of {dtype} {shape} announces {info.nbytes} bytes, not {size}")
        total += size
        if total > max_bytes:
            raise StateError(f"{peer} offers more than {max_bytes} bytes of state (training.max_state_bytes), "
                             f"at tensor {name}", source=peer)
        layout[name] = (shape, dtype)
        sizes.append(size)
    if total != response.total_bytes:
        raise bad(f"total of {response.total_bytes} bytes, but its tensors hold {total}")
    start = (response.start_tensor, response.start_offset)
    if start != (0, 0) and not (start[0] < len(sizes) and start[1] < sizes[start[0]]):
        raise bad(f"payload starting at tensor {start[0]}, offset {start[1]}, outside the state")
    digests = tuple(bytes(info.sha256) for info in response.tensors) if announced == {DIGEST_BYTES} else None
    return Manifest(int(response.step), tuple(layout), layout, tuple(sizes), response.chunk_bytes, start, digests)


def check_against_template(manifest: Manifest, template: Template, peer: str) -> None:
    """StateError naming ``peer`` and a tensor unless the manifest announces exactly ``template``'s tensors."""
    for name, (shape, dtype) in manifest.layout.items():
        if name not in template:
            raise StateError(f"{peer} offers a state with tensor {name}, which this peer does not have",
                             source=peer)
        if template[name] != (shape, dtype):
            want_shape, want_dtype = template[name]
            raise StateError(f"{peer} offers tensor {name} as {dtype} {shape}, this peer has {want_dtype} "
                             f"{want_shape}", source=peer)
    missing = [name for name in template if name not in manifest.layout]
    if missing:
        raise StateError(f"{peer} offers a state without tensor {missing[0]}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}", source=peer)


def chunks(sizes: tuple[int, ...], start: tuple[int, int], chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(tensor index, offset, length) of every payload frame from ``start``, in order: the one cut both sides
    make, so the joiner knows each frame's length before it arrives."""
    index, offset = start
    for i in range(index, len(sizes)):
        at = offset if i == index else 0
        while at < sizes[i]:
            length = min(chunk_bytes, sizes[i] - at)
            yield i, at, length
            at += length

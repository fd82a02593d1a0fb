"""peerd's 8-bit blockwise absmax codec for averaging payloads (wire format: ``protocols/codec.v1.md``).

A large float tensor is cut into blocks of ``block_size`` consecutive elements (row-major order); each block
travels as one bf16 scale and one int8 code per element, ``x ~= code * scale``, codes in [-127, 127]. Tensors
with fewer than ``min_compress_numel`` elements travel as fp16, or raw in their own dtype when fp16 would
overflow them or flush them below the int8 error bound. :func:`decode` trusts nothing in a payload: every
inconsistency raises :class:`~peerd.errors.CodecError` naming the sending peer.

The blocks' arithmetic lives in :mod:`peerd.wire.blockwise` (a C kernel that reads each fp32 element once);
the encoded bytes are written in place into the payload, and decoding can write into a caller's buffer.
"""

from __future__ import annotations

import math
import struct
import warnings
from collections.abc import Sequence
from enum import IntEnum

import torch

from peerd.config import CodecConfig
from peerd.errors import CodecError
from peerd.wire import blockwise, topk
from peerd.wire.blockwise import MAX_SCALE, MIN_SCALE

__all__ = ["HEADER", "MAGIC", "MAX_NDIM", "MAX_SCALE", "MIN_SCALE", "VERSION", "Scheme", "decode", "encode",
           "encode_largest"]

MAGIC = b"PDQ8"
VERSION = 4  # 2 added the 4- and 2-bit schemes, 3 top-k, 4 SPARSE8; a payload is written with the oldest version of its scheme
MAX_NDIM = 32
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 65536
# magic, version, scheme, dtype code, ndim, block size, reserved (0), numel: 24 bytes, bodies stay 8-aligned.
HEADER = struct.Struct("<4sBBBBIIQ")


class Scheme(IntEnum):
    RAW = 0  # body: numel elements of the original dtype
    FP16 = 1  # body: numel fp16 elements, cast back to the original dtype
    INT8_BLOCKWISE = 2  # body: ceil(numel / block_size) bf16 scales, then numel int8 codes
    INT4_BLOCKWISE = 3  # the same scales, then ceil(numel / 2) bytes of 4-bit codes in [-7, 7]
    INT2_BLOCKWISE = 4  # the same scales, then ceil(numel / 4) bytes of 2-bit codes in [-1, 1]
    TOPK8 = 5  # k, the positions of the k largest |x| (Elias-Fano), then their values as INT8_BLOCKWISE codes them
    TOPK4 = 6  # the same, values coded as INT4_BLOCKWISE
    TOPK2 = 7  # the same, values coded as INT2_BLOCKWISE
    SPARSE8 = 8  # the layout of TOPK8; left out: no element larger than one carried (a checkable average)


# the payload version each scheme is written with: the oldest that has it
_VERSIONS = {scheme: 4 if scheme >= Scheme.SPARSE8 else 3 if scheme >= Scheme.TOPK8
             else 2 if scheme >= Scheme.INT4_BLOCKWISE else 1 for scheme in Scheme}
TOPK_BITS = {Scheme.TOPK8: 8, Scheme.TOPK4: 4, Scheme.TOPK2: 2, Scheme.SPARSE8: 8}  # schemes with the top-k layout
_TOPK_SCHEMES = {8: Scheme.TOPK8, 4: Scheme.TOPK4, 2: Scheme.TOPK2}
BLOCKWISE_BITS = {Scheme.INT8_BLOCKWISE: 8, Scheme.INT4_BLOCKWISE: 4, Scheme.INT2_BLOCKWISE: 2}
_SCHEMES = {"blockwise8": Scheme.INT8_BLOCKWISE, "blockwise4": Scheme.INT4_BLOCKWISE, "blockwise2": Scheme.INT2_BLOCKWISE}


DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


FP16_MAX = 65504.0
# Below this absmax the fp16 subnormal step (2**-24) is coarser than the int8 codec's bound absmax / 254.
FP16_MIN_ABSMAX = 254 * 2.0**-25
def encode(tensor: torch.Tensor, config: CodecConfig) -> bytearray:
    """Serializes a float32/float16/bfloat16 tensor; ``bytes(result)`` if an immutable copy is needed.

    Raises ``TypeError`` for other dtypes and ``ValueError`` for NaN/Inf elements (a peer never sends them).
    """
    if tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"codec supports float32, float16 and bfloat16 tensors, got {tensor.dtype}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"codec supports at most {MAX_NDIM} dimensions, got {tensor.dim()}")
    flat = tensor.detach().to("cpu").reshape(-1)  # a view of a contiguous CPU tensor; one gather otherwise
    if config.lossless:
        return _encode_raw(flat, tuple(tensor.shape))
    if flat.numel() >= max(config.min_compress_numel, 1) and config.scheme == "topk":
        k = topk.choose_k(flat.numel(), config.density)
        return _encode_topk(flat, tuple(tensor.shape), config.block_size, config.value_bits, k)
    if flat.numel() >= max(config.min_compress_numel, 1):
        return _encode_blockwise(flat, tuple(tensor.shape), config.block_size, _SCHEMES[config.scheme])
    return _encode_small(flat, tuple(tensor.shape))


def _encode_raw(flat: torch.Tensor, shape: tuple[int, ...]) -> bytearray:
    """Exact values, for parameter and optimizer-state averaging (8-bit noise there would hit the weights)."""
    if not all_finite([flat]):
        raise _non_finite(flat.dtype)
    buf, head = _payload(Scheme.RAW, flat.dtype, shape, 0, flat.numel() * flat.dtype.itemsize)
    if flat.numel():
        torch.frombuffer(buf, dtype=flat.dtype, count=flat.numel(), offset=head).copy_(flat)
    return buf


def _payload(
    scheme: Scheme, dtype: torch.dtype, shape: tuple[int, ...], block: int, body: int
) -> tuple[bytearray, int]:
    head = HEADER.size + 8 * len(shape)
    buf = bytearray(head + body)
    HEADER.pack_into(
        buf, 0, MAGIC, _VERSIONS[scheme], scheme, DTYPE_CODES[dtype], len(shape), block, 0, math.prod(shape)
    )
    struct.pack_into(f"<{len(shape)}Q", buf, HEADER.size, *shape)
    return buf, head


def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    """True if no tensor holds NaN or Inf. A finite sum proves every element finite (NaN and Inf propagate
    through it) at a fraction of the cost of ``isfinite(t).all()`` (which builds a bool tensor, and is slow
    for fp16); only a sum that is not finite (a real NaN/Inf, or finite values whose sum overflows) needs
    the exact check."""
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return True
    sums = torch.stack([t.sum(dtype=torch.float32) for t in present])
    return bool(sums.isfinite().all()) or all(bool(torch.isfinite(t).all()) for t in present)


def _non_finite(dtype: torch.dtype) -> ValueError:
    return ValueError(
        f"refusing to encode a {dtype} tensor containing NaN or Inf; peers must never send them"
    )


def _encode_small(flat: torch.Tensor, shape: tuple[int, ...]) -> bytearray:
    absmax = float(flat.abs().max()) if flat.numel() else 0.0
    if not math.isfinite(absmax):
        raise _non_finite(flat.dtype)
    fits_fp16 = flat.dtype == torch.float16 or absmax == 0.0 or FP16_MIN_ABSMAX <= absmax <= FP16_MAX
    scheme, body_dtype = (Scheme.FP16, torch.float16) if fits_fp16 else (Scheme.RAW, flat.dtype)
    buf, head = _payload(scheme, flat.dtype, shape, 0, flat.numel() * body_dtype.itemsize)
    if flat.numel():
        torch.frombuffer(buf, dtype=body_dtype, count=flat.numel(), offset=head).copy_(flat)
    return buf


def encode_largest(tensor: torch.Tensor, block_size: int, k: int) -> bytearray:
    """SPARSE8: the ``k`` largest |elements| of a float32/float16/bfloat16 tensor (every nonzero one if there are no
    more), their positions and their values coded as INT8_BLOCKWISE codes them (blocks of ``block_size`` sent
    values). What a reducer returns for an average of top-k rows, checkable by members: no element it leaves out
    is larger than one it carries, and each it carries is within half a step of the exact average. Raises like
    :func:`encode`."""
    if tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"codec supports float32, float16 and bfloat16 tensors, got {tensor.dtype}")
    flat = tensor.detach().to("cpu").reshape(-1)
    return _encode_positions(flat, tuple(tensor.shape), block_size, Scheme.SPARSE8, topk.largest(flat, k))


def _encode_topk(flat: torch.Tensor, shape: tuple[int, ...], block: int, bits: int, k: int) -> bytearray:
    return _encode_positions(flat, shape, block, _TOPK_SCHEMES[bits], topk.select(flat, k))


def _encode_positions(flat: torch.Tensor, shape: tuple[int, ...], block: int, scheme: Scheme,
                      positions: torch.Tensor) -> bytearray:
    bits = TOPK_BITS[scheme]
    size = topk.body_size(flat.numel(), positions.numel(), block, bits)
    buf, head = _payload(scheme, flat.dtype, shape, block, size)
    if not topk.encode_body(flat, positions, block, bits, memoryview(buf)[head:]):
        raise _non_finite(flat.dtype)
    return buf


def _body_size(scheme: Scheme, numel: int, block: int) -> tuple[int, int]:
    """(scale count, body bytes) of a blockwise payload."""
    nblocks = -(-numel // block)
    return nblocks, 2 * nblocks + -(-numel * BLOCKWISE_BITS[scheme] // 8)


def _encode_blockwise(flat: torch.Tensor, shape: tuple[int, ...], block: int, scheme: Scheme) -> bytearray:
    numel, bits = flat.numel(), BLOCKWISE_BITS[scheme]
    nblocks, body_size = _body_size(scheme, numel, block)
    buf, head = _payload(scheme, flat.dtype, shape, block, body_size)
    body = memoryview(buf)[head:]
    scales, codes = body[: 2 * nblocks], body[2 * nblocks :]
    if bits == 8:
        finite = blockwise.quantize(flat, scales, codes, block)
    else:
        unpacked = bytearray(numel)
        finite = blockwise.quantize(flat, scales, memoryview(unpacked), block, bits)
        if finite:
            blockwise.pack(torch.frombuffer(unpacked, dtype=torch.int8), codes, bits)
    if not finite:
        raise _non_finite(flat.dtype)
    return buf


def _fail(peer_id: str, reason: str) -> CodecError:
    return CodecError(f"invalid codec payload from peer {peer_id}: {reason}", peer_id=peer_id)


def _view(buf: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    with warnings.catch_warnings():  # received bytes are read-only; decode only ever reads these views
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def decode(
    payload: bytes | bytearray | memoryview,
    *,
    peer_id: str,
    expected_shape: tuple[int, ...] | None = None,
    max_numel: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Validates a payload from ``peer_id`` and returns the tensor, or raises :class:`CodecError`.

    ``out`` (contiguous, with the payload's shape and dtype) receives the result instead of a new tensor,
    which saves the page faults of a fresh allocation (for a large tensor, more than the decoding costs). All
    validation happens before anything is written, so after a ``CodecError`` ``out`` is unchanged.
    """
    buf = memoryview(payload).cast("B")
    size = buf.nbytes
    if size < HEADER.size:
        raise _fail(peer_id, f"truncated: {size} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, scheme_code, dtype_code, ndim, block, reserved, numel = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise _fail(peer_id, f"bad magic {magic!r}, expected {MAGIC!r}")
    if not 1 <= version <= VERSION:
        raise _fail(peer_id, f"unsupported codec version {version}, this peer speaks versions 1 to {VERSION}")
    try:
        scheme = Scheme(scheme_code)
    except ValueError:
        raise _fail(peer_id, f"unknown scheme {scheme_code}") from None
    if _VERSIONS[scheme] > version:
        raise _fail(peer_id, f"scheme {scheme.name} in a version {version} payload (it came with version "
                             f"{_VERSIONS[scheme]})")
    if dtype_code not in _DTYPES:
        raise _fail(peer_id, f"unknown dtype code {dtype_code}")
    dtype = _DTYPES[dtype_code]
    if reserved != 0 or ndim > MAX_NDIM:
        raise _fail(peer_id, f"reserved field {reserved} (must be 0) or ndim {ndim} (max {MAX_NDIM})")
    head = HEADER.size + 8 * ndim
    if size < head:
        raise _fail(peer_id, f"truncated: {size} bytes, shorter than the {head}-byte header with shape")
    shape = struct.unpack_from(f"<{ndim}Q", buf, HEADER.size)
    if math.prod(shape) != numel:
        raise _fail(peer_id, f"numel {numel} does not match shape {shape}")
    # An empty tensor's other dimensions are unbounded by numel; torch computes strides from them in int64.
    if math.prod(max(d, 1) for d in shape) >= 2**63:
        raise _fail(peer_id, f"shape {shape} overflows int64 strides")
    wanted = expected_shape if expected_shape is not None else (None if out is None else tuple(out.shape))
    if wanted is not None and shape != tuple(wanted):
        raise _fail(peer_id, f"shape {shape} differs from the expected {tuple(wanted)}")
    if max_numel is not None and numel > max_numel:
        raise _fail(peer_id, f"{numel} elements exceed the limit of {max_numel}")
    if scheme in BLOCKWISE_BITS:
        if not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
            raise _fail(peer_id, f"block size {block} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
        nblocks, body = _body_size(scheme, numel, block)
    elif scheme in TOPK_BITS:
        if not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
            raise _fail(peer_id, f"block size {block} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
        if wanted is None and max_numel is None:  # a few bytes could claim 2**60 zeros
            raise _fail(peer_id, f"a {scheme.name} payload where no shape or size limit was expected")
        k = topk.read_k(buf[head:])
        if k is None or k > numel:
            raise _fail(peer_id, f"top-k count {k} missing or above the {numel} elements")
        body = topk.body_size(numel, k, block, TOPK_BITS[scheme])
    elif block != 0:
        raise _fail(peer_id, f"block size {block} given for non-blockwise scheme {scheme.name}")
    else:
        body = numel * (2 if scheme is Scheme.FP16 else dtype.itemsize)
    if size != head + body:
        kind = "truncated" if size < head + body else "oversized"
        raise _fail(peer_id, f"{kind}: {size} bytes, but the header announces {head + body}")
    if out is not None:
        if out.dtype != dtype:
            raise _fail(peer_id, f"dtype {dtype} differs from the expected {out.dtype}")
        if not out.is_contiguous():
            raise ValueError("decode(out=...) needs a contiguous tensor")
    result = out if out is not None else torch.empty(shape, dtype=dtype)
    if numel == 0:
        return result
    reason: str | None
    if scheme in TOPK_BITS:
        reason = topk.decode_body(_view(buf, torch.uint8, body, head), block, TOPK_BITS[scheme], result.view(-1))
        if reason is not None:
            raise _fail(peer_id, reason)
        return result
    if scheme in BLOCKWISE_BITS:
        bits = BLOCKWISE_BITS[scheme]
        raw_scales = _view(buf, torch.int16, nblocks, head)
        codes = _view(buf, torch.int8, body - 2 * nblocks, head + 2 * nblocks)
        unpacked = codes if bits == 8 else blockwise.unpack(codes.view(torch.uint8), numel, bits)
        if isinstance(unpacked, str):
            reason = unpacked
        else:
            reason = blockwise.dequantize(raw_scales, unpacked, block, result.view(-1), bits)
        if reason is not None:
            raise _fail(peer_id, reason)
        return result
    values = _view(buf, torch.float16 if scheme is Scheme.FP16 else dtype, numel, head)
    if not all_finite([values]):
        raise _fail(peer_id, f"NaN or Inf in the {scheme.name} body")
    result.view(-1).copy_(values)
    return result

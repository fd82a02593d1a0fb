"""Tests of the 8-bit blockwise codec (peerd.wire.codec), its wire format and error feedback."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import pytest
import torch

from peerd.config import CodecConfig
from peerd.errors import CodecError, ProtocolViolation
from peerd.wire.codec import HEADER, MAGIC, MAX_SCALE, MIN_SCALE, VERSION, Scheme, all_finite, decode, encode
from peerd.wire.feedback import encode_with_feedback

PEER = "12D3KooWTestPeer"
BLOCK = 128
CONFIG = CodecConfig(block_size=BLOCK)
INT8 = CodecConfig(
    block_size=BLOCK, min_compress_numel=0
)  # forces the blockwise scheme even for tiny tensors
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Scales are rounded up to bf16 (8 significant bits), which widens the quantization step by at most 2**-7.
SCALE_SLACK = 1 + 2.0**-7

pytestmark = pytest.mark.timeout(60)


def scheme_of(payload: bytes | bytearray) -> Scheme:
    return Scheme(payload[5])


def roundtrip(x: torch.Tensor, config: CodecConfig = CONFIG) -> tuple[torch.Tensor, bytearray]:
    payload = encode(x, config)
    y = decode(bytes(payload), peer_id=PEER, expected_shape=tuple(x.shape))
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert torch.isfinite(y).all()
    return y, payload


def check_bound(x: torch.Tensor, y: torch.Tensor, payload: bytes | bytearray, block: int = BLOCK) -> None:
    """|x - y| <= absmax/127 * 0.5 per element, with absmax taken over the element's block."""
    xf, yf = x.detach().reshape(-1).double(), y.reshape(-1).double()
    n = xf.numel()
    if n == 0:
        return
    if scheme_of(payload) is Scheme.INT8_BLOCKWISE:
        padded = torch.nn.functional.pad(xf, (0, -n % block))
        absmax = padded.view(-1, block).abs().amax(1).repeat_interleave(block)[:n]
    else:
        absmax = xf.abs().max().expand(n)
    # A narrow output dtype adds its own rounding of the decoded value; 2**-126 covers scales at the floor.
    out_rounding = torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 0.0
    bound = absmax / 127 * 0.5 * SCALE_SLACK + absmax * out_rounding + 2.0**-126
    excess = (xf - yf).abs() - bound
    assert excess.max() <= 0, f"error exceeds the bound by {excess.max().item()} at {excess.argmax().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "numel", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 4095, 4096, 4097, 100_003, (1 << 20) + 17]
)
def test_roundtrip_error_bound(numel: int, dtype: torch.dtype) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    for config in (CONFIG, INT8):
        y, payload = roundtrip(x, config)
        check_bound(x, y, payload)
        if numel >= config.min_compress_numel and numel:
            assert scheme_of(payload) is Scheme.INT8_BLOCKWISE


@pytest.mark.parametrize("block", [8, 64, 100, 128, 1024])
def test_block_sizes_and_partial_last_block(block: int) -> None:
    x = torch.randn(10 * block + 3) * 10
    config = CodecConfig(block_size=block, min_compress_numel=0)
    y, payload = roundtrip(x, config)
    check_bound(x, y, payload, block)
    assert len(payload) == HEADER.size + 8 + 2 * 11 + x.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 300),
        lambda: torch.randn(300, 64).t(),  # transposed
        lambda: torch.randn(40, 50, 30)[:, ::2, 1:],  # strided slice
        lambda: torch.randn(2, 3, 4, 5, 6, 7),
        lambda: torch.randn(1, 5000, 1),
        lambda: torch.randn(4096).expand(3, 4096),  # stride 0
        lambda: torch.randn(0, 7),
        lambda: torch.tensor(3.5),  # 0-d
    ],
)
def test_shapes_and_non_contiguous_input(make: Callable[[], torch.Tensor], dtype: torch.dtype) -> None:
    x = make().to(dtype)
    for config in (CONFIG, INT8):
        y, payload = roundtrip(x, config)
        check_bound(x.contiguous(), y, payload)


@pytest.mark.parametrize("numel", [10, 4096, 100_000])
def test_all_zero_tensor_decodes_to_exact_zeros(numel: int) -> None:
    for dtype in DTYPES:
        x = torch.zeros(numel, dtype=dtype)
        y, _ = roundtrip(x)
        assert torch.equal(y, x)


def test_all_zero_blocks_inside_a_tensor_stay_zero() -> None:
    x = torch.randn(50 * BLOCK + 5)
    x[3 * BLOCK : 7 * BLOCK] = 0
    x[-5:] = 0  # the partial last block
    y, payload = roundtrip(x)
    check_bound(x, y, payload)
    assert torch.equal(y[3 * BLOCK : 7 * BLOCK], x[3 * BLOCK : 7 * BLOCK]) and torch.equal(y[-5:], x[-5:])


@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e-10, 1.0, 1e10, 1e30, 1e36])
@pytest.mark.parametrize("numel", [1000, 50_000])
def test_huge_and_tiny_magnitudes_fp32(magnitude: float, numel: int) -> None:
    x = torch.randn(numel) * magnitude
    y, payload = roundtrip(x)
    check_bound(x, y, payload)
    if numel < CONFIG.min_compress_numel and not 1e-5 < magnitude < 1e4:
        assert scheme_of(payload) is Scheme.RAW  # fp16 would overflow or flush to zero


def test_blocks_spanning_the_whole_fp32_range() -> None:
    exponents = torch.arange(400).remainder(76).sub(38).float()  # block magnitudes from 1e-38 to 1e37
    x = (torch.rand(400, BLOCK) * 2 - 1) * torch.pow(10.0, exponents).unsqueeze(1)
    y, payload = roundtrip(x)
    check_bound(x, y, payload)


def test_extreme_fp32_values_do_not_overflow() -> None:
    fmax = torch.finfo(torch.float32).max
    x = torch.randn(3 * BLOCK)
    x[:BLOCK] = fmax
    x[BLOCK] = -fmax
    x[2 * BLOCK :] = torch.randn(BLOCK) * 1e-44  # subnormals
    y, payload = roundtrip(x, INT8)
    check_bound(x, y, payload)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_dtype_maximum_saturates_instead_of_overflowing(dtype: torch.dtype) -> None:
    x = torch.full((4 * BLOCK,), torch.finfo(dtype).max, dtype=dtype)
    x[1::2] *= -1
    y, payload = roundtrip(x, INT8)
    check_bound(x, y, payload)


@pytest.mark.parametrize("block", [128, 256, 1024])
def test_bytes_per_element_for_large_tensors(block: int) -> None:
    x = torch.randn(1 << 20)
    payload = encode(x, CodecConfig(block_size=block))
    assert len(payload) / x.numel() <= 1.03


def test_small_tensors_use_fp16_and_large_ones_int8() -> None:
    assert scheme_of(encode(torch.randn(100), CONFIG)) is Scheme.FP16
    assert scheme_of(encode(torch.randn(100) * 1e5, CONFIG)) is Scheme.RAW
    assert scheme_of(encode(torch.randn(100, dtype=torch.bfloat16) * 1e6, CONFIG)) is Scheme.RAW
    assert scheme_of(encode(torch.randn(5000), CONFIG)) is Scheme.INT8_BLOCKWISE
    y, _ = roundtrip(torch.randn(100) * 1e5)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("numel", [10, 10_000])
def test_encode_rejects_non_finite_input(bad: float, numel: int) -> None:
    for dtype in DTYPES:
        x = torch.randn(numel).to(dtype)
        x[numel // 2] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            encode(x, CONFIG)


def test_encode_rejects_unsupported_dtypes() -> None:
    with pytest.raises(TypeError, match="float32"):
        encode(torch.arange(10), CONFIG)
    with pytest.raises(TypeError):
        encode(torch.randn(10, dtype=torch.float64), CONFIG)


def test_wire_header_layout() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5]])
    payload = encode(x, CodecConfig(block_size=8, min_compress_numel=0))
    magic, version, scheme, dtype, ndim, block, reserved, numel = HEADER.unpack_from(payload)
    assert (magic, version, scheme, dtype, ndim, block, reserved, numel) == (MAGIC, 1, 2, 0, 2, 8, 0, 3)
    assert HEADER.size == 24 and struct.unpack_from("<2Q", payload, 24) == (1, 3)
    (scale,) = struct.unpack("<f", b"\0\0" + bytes(payload[40:42]))  # bf16 = high half of an fp32
    assert 2 / 127 <= scale <= 2 / 127 * SCALE_SLACK
    codes = list(struct.unpack_from("<3b", payload, 42))
    assert codes == [round(1 / scale), round(-2 / scale), round(0.5 / scale)]
    assert len(payload) == 45


# ---- malformed payloads --------------------------------------------------------------------------------


def int8_payload(numel: int = 3 * BLOCK + 5) -> bytearray:
    return encode(torch.randn(numel), INT8)


def fp16_payload() -> bytearray:
    return encode(torch.randn(3, 5), CONFIG)


def raw_payload() -> bytearray:
    return encode(torch.full((4,), 1e6), CONFIG)  # fp16 would overflow: sent as raw fp32


def patch(payload: bytearray, offset: int, fmt: str, *values: object) -> bytearray:
    out = bytearray(payload)
    struct.pack_into(fmt, out, offset, *values)
    return out


SCALES_AT = HEADER.size + 8  # 1-d payloads: scales start right after the one shape entry
CODES_AT = SCALES_AT + 2 * 4  # 3 * BLOCK + 5 elements -> 4 blocks
BF16 = {"nan": 0x7FC0, "inf": 0x7F80, "-inf": 0xFF80, "negative": 0xBF80, "-0": 0x8000, "too large": 0x7F00}

MALFORMED: dict[str, tuple[Callable[[], bytes | bytearray], str]] = {
    "empty": (lambda: b"", "truncated"),
    "short header": (lambda: int8_payload()[:10], "truncated"),
    "header only": (lambda: int8_payload()[: HEADER.size], "truncated"),
    "truncated body": (lambda: int8_payload()[:-1], "truncated"),
    "extra byte": (lambda: int8_payload() + b"\0", "oversized"),
    "bad magic": (lambda: patch(int8_payload(), 0, "<4s", b"XXXX"), "magic"),
    "bad version": (lambda: patch(int8_payload(), 4, "<B", 5), "version"),
    "version 0": (lambda: patch(int8_payload(), 4, "<B", 0), "version"),
    "unknown scheme": (lambda: patch(int8_payload(), 5, "<B", 9), "scheme"),
    "unknown dtype": (lambda: patch(int8_payload(), 6, "<B", 7), "dtype"),
    "ndim too large": (lambda: patch(int8_payload(), 7, "<B", 200), "ndim"),
    "reserved set": (lambda: patch(int8_payload(), 12, "<I", 1), "reserved"),
    "numel mismatch": (lambda: patch(int8_payload(), 16, "<Q", 3 * BLOCK + 4), "numel"),
    "shape mismatch": (lambda: patch(int8_payload(), 24, "<Q", 3 * BLOCK + 4), "numel"),
    "block size zero": (lambda: patch(int8_payload(), 8, "<I", 0), "block size"),
    "block size changed": (lambda: patch(int8_payload(), 8, "<I", 64), "truncated"),
    "block size grown": (lambda: patch(int8_payload(), 8, "<I", 4096), "oversized"),
    "block size on fp16": (lambda: patch(fp16_payload(), 8, "<I", 64), "block size"),
    "scale nan": (lambda: patch(int8_payload(), SCALES_AT, "<H", BF16["nan"]), "scale"),
    "scale inf": (lambda: patch(int8_payload(), SCALES_AT + 2, "<H", BF16["inf"]), "scale"),
    "scale -inf": (lambda: patch(int8_payload(), SCALES_AT + 4, "<H", BF16["-inf"]), "scale"),
    "scale negative": (lambda: patch(int8_payload(), SCALES_AT + 6, "<H", BF16["negative"]), "scale"),
    "scale negative zero": (lambda: patch(int8_payload(), SCALES_AT, "<H", BF16["-0"]), "scale"),
    "scale too large": (lambda: patch(int8_payload(), SCALES_AT, "<H", BF16["too large"]), "scale"),
    "code -128": (lambda: patch(int8_payload(), CODES_AT + 17, "<b", -128), "-128"),
    "code -128 in tail": (lambda: patch(int8_payload(), CODES_AT + 3 * BLOCK + 4, "<b", -128), "-128"),
    "nan in fp16 body": (lambda: patch(fp16_payload(), HEADER.size + 16 + 6, "<e", math.nan), "NaN"),
    "inf in fp16 body": (lambda: patch(fp16_payload(), HEADER.size + 16, "<e", math.inf), "NaN or Inf"),
    "inf in raw body": (lambda: patch(raw_payload(), HEADER.size + 8, "<f", math.inf), "Inf"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_payload_is_rejected_naming_the_peer(case: str) -> None:
    make, reason = MALFORMED[case]
    with pytest.raises(CodecError, match=reason) as excinfo:
        decode(bytes(make()), peer_id=PEER)
    assert PEER in str(excinfo.value) and excinfo.value.context["peer_id"] == PEER
    assert isinstance(excinfo.value, ProtocolViolation)


def test_unmodified_fixtures_decode() -> None:
    for payload in (int8_payload(), fp16_payload()):
        decode(payload, peer_id=PEER)


def test_expected_shape_and_max_numel_are_enforced() -> None:
    payload = encode(torch.randn(64, 100), CONFIG)
    assert decode(payload, peer_id=PEER, expected_shape=(64, 100), max_numel=6400).shape == (64, 100)
    with pytest.raises(CodecError, match=f"{PEER}.*expected"):
        decode(payload, peer_id=PEER, expected_shape=(100, 64))
    with pytest.raises(CodecError, match=f"{PEER}.*limit of 6399"):
        decode(payload, peer_id=PEER, max_numel=6399)


def test_decode_accepts_memoryview_slices_and_bytes() -> None:
    x = torch.randn(10_000)
    payload = bytes(encode(x, CONFIG))
    framed = b"\x01" * 3 + payload + b"\x02" * 5  # unaligned inside a larger frame
    y1 = decode(memoryview(framed)[3 : 3 + len(payload)], peer_id=PEER)
    assert torch.equal(y1, decode(payload, peer_id=PEER))


def test_decode_into_out() -> None:
    x = torch.randn(70, 100, dtype=torch.bfloat16)
    payload = encode(x, CONFIG)
    out = torch.empty(70, 100, dtype=torch.bfloat16)
    assert decode(payload, peer_id=PEER, out=out) is out
    assert torch.equal(out, decode(payload, peer_id=PEER))
    with pytest.raises(CodecError, match="dtype"):
        decode(payload, peer_id=PEER, out=torch.empty(70, 100))
    with pytest.raises(CodecError, match="shape"):
        decode(payload, peer_id=PEER, out=torch.empty(100, 70, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        decode(payload, peer_id=PEER, out=torch.empty(100, 70, dtype=torch.bfloat16).t())


@pytest.mark.parametrize("case", ["code -128", "scale nan", "nan in fp16 body"])
def test_rejected_payload_leaves_out_untouched(case: str) -> None:
    payload = MALFORMED[case][0]()
    _, _, _, dtype, ndim, _, _, _ = HEADER.unpack_from(payload)
    shape = struct.unpack_from(f"<{ndim}Q", payload, HEADER.size)
    out = torch.full(shape, 42.0)
    with pytest.raises(CodecError):
        decode(payload, peer_id=PEER, out=out)
    assert dtype == 0 and bool((out == 42.0).all())


def test_scale_constants() -> None:
    assert math.isfinite(float(torch.tensor(MAX_SCALE) * 127))
    for value in (MAX_SCALE, MIN_SCALE):
        assert torch.tensor(value).bfloat16().item() == value  # exactly representable on the wire
    assert VERSION == 4


# ---- error feedback ------------------------------------------------------------------------------------


def test_error_feedback_drives_accumulated_error_to_zero() -> None:
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(7))
    residual = torch.zeros_like(x)
    rounds, total = 50, torch.zeros_like(x, dtype=torch.float64)
    single = None
    for _ in range(rounds):
        payload, _ = encode_with_feedback(x, CONFIG, PEER, carried=residual, dropped=residual)
        decoded = decode(payload, peer_id=PEER)
        single = single if single is not None else ((decoded - x).norm() / x.norm()).item()
        total += decoded
    averaged = ((total / rounds - x).norm() / x.norm()).item()
    assert single is not None and single > 1e-3
    assert averaged < single / 10, (averaged, single)
    # Without feedback the same rounding repeats every round, so averaging does not help at all.
    plain = decode(encode(x, CONFIG), peer_id=PEER)
    assert math.isclose(((plain - x).norm() / x.norm()).item(), single, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_residual_is_input_minus_decoded_and_updated_in_place(dtype: torch.dtype) -> None:
    x = torch.randn(300, 50).to(dtype)
    residual = torch.zeros_like(x)
    payload, _ = encode_with_feedback(x, CONFIG, PEER, carried=residual, dropped=residual)
    assert torch.equal(residual, x - decode(payload, peer_id=PEER))
    compensated = x + residual
    buffer = residual.data_ptr()
    payload, norm = encode_with_feedback(x, CONFIG, PEER, carried=residual, dropped=residual, with_norm=True)
    assert residual.data_ptr() == buffer  # no new allocation
    assert torch.equal(residual, compensated - decode(payload, peer_id=PEER))
    assert math.isclose(norm, float(compensated.norm()), rel_tol=1e-6)


def test_error_feedback_sender_keeps_dropped_apart_until_committed() -> None:
    """A member's contribution: the residual is untouched until the reducer reports the chunk included."""
    x, carried = torch.randn(10_000), torch.randn(10_000) * 0.01
    before, dropped = carried.clone(), torch.empty(10_000)
    payload, norm = encode_with_feedback(x, CONFIG, PEER, carried=carried, dropped=dropped, with_norm=True)
    assert torch.equal(carried, before)
    decoded = decode(payload, peer_id=PEER)
    assert torch.equal(dropped, (x + before) - decoded)
    assert math.isclose(norm, float((x + before).norm()), rel_tol=1e-6)
    assert ((decoded - (x + before)).norm() / (x + before).norm()).item() < 2e-2


def test_error_feedback_reducer_decodes_in_place_and_commits_at_once() -> None:
    """A reducer's average: it applies exactly what members decode, and keeps what that dropped."""
    average, residual = torch.randn(10_000), torch.randn(10_000) * 0.01
    coded = average + residual
    payload, _ = encode_with_feedback(average, CONFIG, PEER, carried=residual, dropped=residual, decoded=average)
    assert torch.equal(average, decode(payload, peer_id=PEER))
    assert torch.equal(residual, coded - average)
    # without error feedback: still decoded in place, nothing else touched
    values = torch.randn(10_000)
    payload, norm = encode_with_feedback(values.clone(), CONFIG, PEER, decoded=values)
    assert torch.equal(values, decode(payload, peer_id=PEER)) and norm == 0.0


def test_error_feedback_without_buffers_is_plain_encode() -> None:
    x = torch.randn(5000)
    assert encode_with_feedback(x, CONFIG, PEER) == (encode(x, CONFIG), 0.0)


def test_error_feedback_refuses_mismatched_buffers() -> None:
    x = torch.randn(5000)
    with pytest.raises(ValueError, match="carried is \\(5001,\\)"):
        encode_with_feedback(x, CONFIG, PEER, carried=torch.zeros(5001), dropped=torch.zeros(5000))
    with pytest.raises(ValueError, match="decoded is .* torch.float16"):
        encode_with_feedback(x, CONFIG, PEER, decoded=torch.zeros(5000, dtype=torch.float16))
    with pytest.raises(ValueError, match="needs `dropped`"):
        encode_with_feedback(x, CONFIG, PEER, carried=torch.zeros(5000))


def test_all_finite_is_exact_even_when_a_sum_overflows() -> None:
    assert all_finite([]) and all_finite([torch.empty(0), None])
    assert all_finite([torch.full((4,), 3e38)])  # the fp32 sum overflows; every value is finite
    assert all_finite([torch.full((8,), 60000.0, dtype=torch.float16)])
    for bad in (math.nan, math.inf, -math.inf):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = torch.ones(1000, dtype=dtype)
            t[517] = bad
            assert not all_finite([torch.ones(3), t]), (bad, dtype)

"""The codec's narrow schemes (4- and 2-bit blockwise codes): their error bound, packing, and every malformed
payload refused naming the peer."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import CodecError
from peerd.wire.blockwise import QMAX
from peerd.wire.codec import HEADER, Scheme, decode, encode
from peerd.wire.feedback import encode_with_feedback

PEER = "12D3KooWNarrowCodes"
WIDTHS = {"blockwise4": (4, Scheme.INT4_BLOCKWISE), "blockwise2": (2, Scheme.INT2_BLOCKWISE)}

pytestmark = pytest.mark.timeout(60)


def config(scheme: str, block: int = 128) -> CodecConfig:
    return CodecConfig(scheme=scheme, block_size=block, min_compress_numel=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", list(WIDTHS))
@pytest.mark.parametrize("numel", [1, 2, 3, 5, 127, 128, 129, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_roundtrip_within_half_a_step_and_the_size_is_exact(scheme: str, numel: int, dtype: torch.dtype) -> None:
    bits, code = WIDTHS[scheme]
    block = 128
    x = (torch.randn(numel) * 3).to(dtype)
    payload = encode(x, config(scheme, block))
    assert payload[4] == 2 and payload[5] == code  # version 2 brought the narrow schemes
    nblocks = -(-numel // block)
    assert len(payload) == HEADER.size + 8 + 2 * nblocks + -(-numel * bits // 8)
    y = decode(bytes(payload), peer_id=PEER, expected_shape=(numel,))
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.double(), y.double()
    padded = torch.nn.functional.pad(xf.abs(), (0, -numel % block))
    absmax = padded.view(-1, block).amax(1).repeat_interleave(block)[:numel]
    rounding = torch.finfo(dtype).eps * absmax if dtype != torch.float32 else 0.0
    bound = absmax / QMAX[bits] * 0.5 * (1 + 2.0**-7) + rounding + 2.0**-126
    assert bool(((xf - yf).abs() <= bound).all())


@pytest.mark.parametrize("scheme", list(WIDTHS))
def test_codes_reach_both_ends_and_zero_is_exact(scheme: str) -> None:
    bits, _ = WIDTHS[scheme]
    q = QMAX[bits]
    pattern = [float(v) for v in range(-q, q + 1)] + [float(q)]  # every block's largest |x| is q: scale 1
    repeats = -(-8 // len(pattern))
    x = torch.tensor(pattern * repeats * 5)
    y = decode(bytes(encode(x, config(scheme, len(pattern) * repeats))), peer_id=PEER)
    assert torch.equal(x, y)
    assert torch.equal(decode(bytes(encode(torch.zeros(77), config(scheme))), peer_id=PEER), torch.zeros(77))


@pytest.mark.parametrize("scheme", list(WIDTHS))
def test_fp32_extremes_stay_finite(scheme: str) -> None:
    x = torch.tensor([3.4028235e38, -3.4028235e38, 1.0, -1e-45] * 8)
    y = decode(bytes(encode(x, config(scheme, 8))), peer_id=PEER)
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("coded", [
    *(config(scheme) for scheme in WIDTHS),
    *(CodecConfig(scheme="topk", value_bits=bits, min_compress_numel=0) for bits in (8, 4, 2)),  # type: ignore[arg-type]
], ids=lambda c: f"{c.scheme}{c.value_bits if c.scheme == 'topk' else ''}")
def test_error_feedback_makes_the_sum_of_rounds_exact_but_one_residual(coded: CodecConfig) -> None:
    torch.manual_seed(3)
    carried = torch.zeros(8192)
    sent = torch.zeros(8192, dtype=torch.float64)
    total = torch.zeros(8192, dtype=torch.float64)
    for _ in range(60):
        values = torch.randn(8192)
        payload, _ = encode_with_feedback(values, coded, PEER, carried=carried, dropped=carried)
        sent += decode(bytes(payload), peer_id=PEER, expected_shape=(8192,)).double()
        total += values.double()
    assert torch.allclose(sent + carried.double(), total, atol=1e-3)
    # the residual stays bounded: it does not grow with the rounds (dense codes: within one round's worth; top-k:
    # a held-back element grows until it ranks among the largest, then travels)
    assert float(carried.abs().max()) < (20 if coded.scheme != "topk" else float(total.abs().max()))


def corrupted(scheme: str, case: str) -> bytes:
    bits, _ = WIDTHS[scheme]
    numel = 129 if bits == 4 else 130  # a partly used last byte
    payload = encode(torch.randn(numel), config(scheme))
    head, nblocks = HEADER.size + 8, 2
    if case == "lowest code":
        payload[head + 2 * nblocks] = 1 << (bits - 1)  # the first element: -8 or -2
    elif case == "padding bits":
        payload[-1] |= 0x80
    elif case == "scale infinite":
        payload[head : head + 2] = (0x7F80).to_bytes(2, "little")
    elif case == "truncated":
        del payload[-1]
    elif case == "version 1":
        payload[4] = 1
    return bytes(payload)


@pytest.mark.parametrize("scheme", list(WIDTHS))
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("lowest code", "the encoder only emits"),
        ("padding bits", "non-zero bits after the last code"),
        ("scale infinite", "block scale"),
        ("truncated", "truncated"),
        ("version 1", "in a version 1 payload"),
    ],
)
def test_malformed_narrow_payloads_are_refused_and_leave_out_untouched(scheme: str, case: str, reason: str) -> None:
    payload = corrupted(scheme, case)
    numel = 129 if scheme == "blockwise4" else 130
    out = torch.full((numel,), 7.0)
    with pytest.raises(CodecError, match=reason) as caught:
        decode(payload, peer_id=PEER, out=out)
    assert PEER in str(caught.value)
    assert bool((out == 7.0).all())


def test_narrow_codes_without_error_feedback_are_refused_naming_the_option() -> None:
    with pytest.raises(ValidationError, match="averaging.codec.error_feedback"):
        AveragingConfig(codec=CodecConfig(scheme="blockwise2", error_feedback=False))
    AveragingConfig(codec=CodecConfig(scheme="blockwise8", error_feedback=False))
    assert CodecConfig(scheme="blockwise4").scheme == "blockwise4"
    with pytest.raises(ValidationError, match="scheme"):
        CodecConfig(scheme="blockwise3")  # type: ignore[arg-type]


def test_lossless_ignores_the_scheme() -> None:
    x = torch.randn(5000)
    lossless = CodecConfig(scheme="blockwise2", lossless=True)
    assert torch.equal(decode(bytes(encode(x, lossless)), peer_id=PEER), x)

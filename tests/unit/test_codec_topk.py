"""Top-k payloads (schemes TOPK8/4/2): the largest elements travel, the rest decode as zero, error feedback
carries them, and every malformed payload is refused naming the peer. SPARSE8, the same layout carrying an
average's largest elements, or every nonzero one (a reducer's checkable average of top-k rows)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from peerd.averaging.verify.payloads import code_average, sent_count
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import CodecError
from peerd.wire import sparse
from peerd.wire.blockwise import QMAX
from peerd.wire.codec import HEADER, Scheme, decode, encode, encode_largest
from peerd.wire.feedback import encode_with_feedback, readd_left_out
from peerd.wire.topk import choose_k

PEER = "12D3KooWTopKPeer"

pytestmark = pytest.mark.timeout(60)


def config(bits: int = 2, density: float = 0.0156, block: int = 128) -> CodecConfig:
    return CodecConfig(scheme="topk", value_bits=bits, density=density, block_size=block,  # type: ignore[arg-type]
                       min_compress_numel=0)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel", [1, 2, 100, 4096, 65_537])
@pytest.mark.parametrize("density", [0.0156, 0.1, 1.0])
def test_the_largest_travel_within_the_value_bound_and_the_rest_are_zero(bits: int, numel: int,
                                                                           density: float) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    payload = encode(x, config(bits, density))
    assert payload[4] == 3 and payload[5] == {8: Scheme.TOPK8, 4: Scheme.TOPK4, 2: Scheme.TOPK2}[bits]
    y = decode(bytes(payload), peer_id=PEER, expected_shape=(numel,))
    k = choose_k(numel, density)
    chosen = torch.topk(x.abs(), k).indices
    outside = torch.ones(numel, dtype=torch.bool)
    outside[chosen] = False
    assert bool((y[outside] == 0).all())
    # each sent value is within half a code step of its block of sent values (128 at a time, in position order)
    sent = chosen.sort().values
    values, decoded = x[sent].double(), y[sent].double()
    if bits == 2:
        assert_best_ternary(values, decoded)
        return
    padded = torch.nn.functional.pad(values.abs(), (0, -k % 128))
    absmax = padded.view(-1, 128).amax(1).repeat_interleave(128)[:k]
    assert bool(((values - decoded).abs() <= absmax / QMAX[bits] * 0.5 * (1 + 2.0**-7) + 2.0**-126).all())


@pytest.mark.parametrize("nonzero", [0, 1, 300, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse8_carries_every_nonzero_element_within_half_a_step(nonzero: int, dtype: torch.dtype) -> None:
    numel = 20_000
    generator = torch.Generator().manual_seed(nonzero)
    x = torch.zeros(numel, dtype=dtype)
    where = torch.randperm(numel, generator=generator)[:nonzero]
    x[where] = torch.randn(nonzero, generator=generator).to(dtype) * 10
    payload = encode_largest(x.view(100, 200), 128, 5000)  # k at least the nonzero elements: all of them
    assert payload[4] == 4 and payload[5] == Scheme.SPARSE8 and sent_count(payload) == nonzero
    y = decode(bytes(payload), peer_id=PEER, expected_shape=(100, 200)).view(-1)
    assert y.dtype == dtype and bool((y[x == 0] == 0).all())
    sent = where.sort().values
    values, decoded = x[sent].double(), y[sent].double()
    padded = torch.nn.functional.pad(values.abs(), (0, -nonzero % 128))
    absmax = padded.view(-1, 128).amax(1).repeat_interleave(128)[:nonzero] if nonzero else padded
    assert bool(((values - decoded).abs() <= absmax / 127 * 0.5 * (1 + 2.0**-7) + 2.0**-126 + 1e-2 * (
        dtype == torch.bfloat16) * values.abs()).all())
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_largest(torch.tensor([0.0, float("nan"), 1.0]), 128, 3)
    # version 3 decoders know no SPARSE8; a version 3 payload claiming it is refused
    old = bytearray(payload)
    old[4] = 3
    with pytest.raises(CodecError, match="SPARSE8 in a version 3 payload"):
        decode(bytes(old), peer_id=PEER, expected_shape=(100, 200))


@pytest.mark.parametrize("numel", [50_000, 1 << 19])  # ranked exactly, and from a sampled bar
def test_sparse8_with_fewer_slots_than_nonzero_elements_carries_exactly_k_of_the_largest(numel: int) -> None:
    """Whatever SPARSE8 leaves out is no larger than what it carries, and it carries exactly ``k`` (members check
    both: verify/payloads.error_bound), also where the sampled bar of ``select`` would have let fewer through."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[torch.arange(0, numel, 7)] = 0.0
    k = numel // 50
    payload = encode_largest(x, 128, k)
    assert sent_count(payload) == k
    y = decode(bytes(payload), peer_id=PEER, expected_shape=(numel,))
    carried = y != 0
    assert int(carried.sum()) == k  # no value of this data rounds to 0
    assert float(x[~carried].abs().max()) <= float(x[carried].abs().min())


def assert_best_ternary(values: torch.Tensor, decoded: torch.Tensor, block: int = 128) -> None:
    """Each block of sent values decodes as -s, 0 or s with the least squared error any such code has (up to
    the bf16 rounding of s), which is no more than the absmax-scaled 2-bit code's."""
    for start in range(0, values.numel(), block):
        v, q = values[start : start + block], decoded[start : start + block]
        assert len(set(q.abs().tolist()) - {0.0}) <= 1, q
        error = float((v - q).square().sum())
        magnitudes = v.abs().sort(descending=True).values
        sums = magnitudes.cumsum(0)
        best = float((v.square().sum() - sums.square() / torch.arange(1, v.numel() + 1)).min())
        absmax = float(magnitudes[0])
        absmax_code = torch.where(v.abs() >= absmax / 2, v.sign() * absmax, 0.0)
        # rounding the best s to bf16 (relative error 2^-9) adds m (s' - s)^2 <= 2^-18 of the block's squares
        slack = 2.0**-16 * float(v.square().sum()) + 1e-30
        assert error <= best + slack
        assert error <= float((v - absmax_code).square().sum()) + slack


def test_two_bit_values_fit_their_blocks_where_absmax_scaling_would_zero_them() -> None:
    # each block of sent values holds one outlier: the absmax scale would send the other 127 as 0
    x = torch.zeros(1 << 16)
    x[::64] = torch.linspace(1.0, 2.0, 1024)
    x[::8192] = 5.0
    y = decode(bytes(encode(x, config(2, 1024 / (1 << 16)))), peer_id=PEER, expected_shape=(1 << 16,))
    sent = x != 0
    assert_best_ternary(x[sent].double(), y[sent].double())
    assert int((y[sent] != 0).sum()) > 1000  # the outliers' neighbours travel too
    assert float((x - y).norm()) < 0.5 * float((x - (x >= 2.5) * 5.0).norm())


def test_two_bit_top_k_is_past_forty_times_fewer_bytes_than_eight_bit() -> None:
    x = torch.randn(1 << 20)
    dense = len(encode(x, CodecConfig()))
    sparse_bytes = len(encode(x, config(2, 0.0156)))
    assert dense / sparse_bytes >= 40, dense / sparse_bytes
    assert x.numel() * 4 / sparse_bytes >= 160  # against dense fp32


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.randn(10_000)
    x[1234] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode(x, config())


def positions_offset() -> int:
    return HEADER.size + 8 + 8  # one dimension, then k


def malformed(case: str) -> tuple[bytes, int]:
    numel = 5000
    payload = encode(torch.randn(numel, generator=torch.Generator().manual_seed(1)), config(2, 0.01))
    k = choose_k(numel, 0.01)
    if case == "k above numel":
        payload[HEADER.size + 8 : HEADER.size + 16] = (numel + 1).to_bytes(8, "little")
    elif case == "k of another size":
        payload[HEADER.size + 8 : HEADER.size + 16] = (k - 1).to_bytes(8, "little")
    elif case == "a position bit moved":  # the first high bit cleared: one position fewer in the bitmap
        low = sparse.low_bits(numel, k)
        bit = k * low + int(torch.nonzero(torch.tensor(
            [(payload[positions_offset() + (k * low + i) // 8] >> ((k * low + i) % 8)) & 1 for i in range(64)]
        ))[0])
        payload[positions_offset() + bit // 8] &= ~(1 << (bit % 8)) & 0xFF
    elif case == "lowest value code":
        scales = 2 * -(-k // 128)
        payload[positions_offset() + sparse.positions_size(numel, k) + scales] = 0b10  # the first code: -2
    elif case == "truncated":
        del payload[-1]
    elif case == "version 2":
        payload[4] = 2
    return bytes(payload), numel


@pytest.mark.parametrize(("case", "reason"), [
    ("k above numel", "top-k count"),
    ("k of another size", "announces|positions"),
    ("a position bit moved", "positions"),
    ("lowest value code", "the encoder only emits"),
    ("truncated", "truncated"),
    ("version 2", "in a version 2 payload"),
])
def test_malformed_top_k_payloads_are_refused_and_leave_out_untouched(case: str, reason: str) -> None:
    payload, numel = malformed(case)
    out = torch.full((numel,), 7.0)
    with pytest.raises(CodecError, match=reason) as caught:
        decode(payload, peer_id=PEER, out=out)
    assert PEER in str(caught.value)
    assert bool((out == 7.0).all())


def test_a_top_k_payload_is_decoded_only_against_a_shape_or_a_limit() -> None:
    payload = bytes(encode(torch.randn(5000), config()))
    with pytest.raises(CodecError, match="no shape or size limit"):
        decode(payload, peer_id=PEER)
    assert decode(payload, peer_id=PEER, max_numel=5000).shape == (5000,)


def test_top_k_needs_error_feedback_naming_the_option() -> None:
    with pytest.raises(ValidationError, match="averaging.codec.error_feedback"):
        AveragingConfig(codec=CodecConfig(scheme="topk", error_feedback=False))
    with pytest.raises(ValidationError, match="density"):
        CodecConfig(density=0.0)


@pytest.mark.parametrize("k", [0, 1, 2, 17, 999, 1000])
def test_positions_round_trip_at_every_count(k: int) -> None:
    n = 1000
    positions = torch.randperm(n, generator=torch.Generator().manual_seed(k))[:k].sort().values
    buf = bytearray(sparse.positions_size(n, k))
    sparse.encode_positions(positions, n, memoryview(buf))
    decoded = sparse.decode_positions(torch.tensor(list(buf), dtype=torch.uint8), n, k)
    assert isinstance(decoded, torch.Tensor) and torch.equal(decoded, positions)


@pytest.mark.parametrize("density", [0.0156, 0.001, 0.3])
def test_sampled_selection_takes_the_largest(density: float) -> None:
    from peerd.wire.topk import select

    torch.manual_seed(11)
    x = torch.distributions.StudentT(3.0).sample((1 << 19,)).float()
    k = choose_k(x.numel(), density)
    chosen = select(x, k)
    assert chosen.numel() <= k and chosen.numel() >= 0.9 * k
    assert bool((chosen[1:] > chosen[:-1]).all())
    truth = torch.topk(x.abs(), chosen.numel()).indices.sort().values
    assert torch.equal(chosen, truth)  # however many it takes, they are the largest


def test_with_sparse8_averages_what_a_round_leaves_out_is_carried_by_the_members() -> None:
    """Members send top-k rows with error feedback, the reducer (member 0) adds its own row exactly, and the
    average returns as SPARSE8 with no residual of the reducer's: each member puts back what the average left
    out of its own row. Over many rounds nothing is lost: the averages applied plus the members' mean residual
    equal the mean of everything the members had to send, up to the average's rounding at the elements it
    carried (which nobody can recover: no member knows the exact average)."""
    numel, members, rounds = 8192, 3, 40
    config = CodecConfig(scheme="topk", density=0.02, min_compress_numel=0)
    generator = torch.Generator().manual_seed(5)
    residuals = [torch.zeros(numel) for _ in range(members)]
    wanted, applied, rounding = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    for _ in range(rounds):
        values = [torch.randn(numel, generator=generator) * (1 + torch.arange(numel) % 7) for _ in range(members)]
        wanted += sum(values) / members
        rows = []
        for j, value in enumerate(values):
            if j == 0:  # the reducer's own row: exact, never sent
                rows.append(value + residuals[0])
                residuals[0].zero_()
            else:
                sent = torch.empty(numel)
                encode_with_feedback(value, config, PEER, carried=residuals[j], dropped=residuals[j], decoded=sent)
                rows.append(sent)
        exact = sum(rows) / members
        average = exact.clone()
        payload = code_average(average, None, config, True, PEER, max(choose_k(numel, 0.02), 1))
        assert payload[5] == Scheme.SPARSE8
        for j in range(members):
            readd_left_out(residuals[j], rows[j], average)
        applied += average
        rounding += torch.where(average != 0, exact - average, 0.0)
    carried = sum(residuals) / members
    assert torch.allclose(applied + rounding + carried, wanted, atol=1e-3)
    assert float(rounding.abs().max()) < 0.05 * float(wanted.abs().max())

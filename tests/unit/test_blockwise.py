"""The codec's C encoder (peerd/wire/_blockwise.c) against its torch path: the same bytes for every instruction
set the CPU has, and the same refusal of NaN and Inf wherever they sit."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from peerd.config import CodecConfig
from peerd.wire import blockwise
from peerd.wire.codec import encode

pytestmark = pytest.mark.timeout(120)


def test_the_kernel_is_built_wherever_a_c_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the package was built without the kernel")
    assert blockwise.kernel() != "torch", "a C compiler is here but peerd.wire._blockwise was not built"


needs_kernel = pytest.mark.skipif(blockwise.kernel() == "torch", reason="built without the C kernel")


def instruction_sets() -> list[str]:
    if blockwise._blockwise is None:
        return []
    kernel, default = blockwise._blockwise, blockwise._blockwise.isa()
    available = []
    for name in ("scalar", "sse2", "avx2"):
        try:
            kernel.isa(name)
        except ValueError:
            continue
        available.append(name)
    kernel.isa(default)
    return available


@contextmanager
def instruction_set(name: str) -> Iterator[None]:
    assert blockwise._blockwise is not None
    default = blockwise._blockwise.isa()
    blockwise._blockwise.isa(name)
    try:
        yield
    finally:
        blockwise._blockwise.isa(default)


def samples() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    yield "normal", torch.randn(5000, generator=g)
    yield "zeros", torch.zeros(777)
    yield "one element", torch.tensor([-3.5])
    yield "zero blocks inside", torch.cat([torch.zeros(300), torch.randn(300, generator=g), torch.zeros(301)])
    yield "subnormals", torch.randn(1031, generator=g) * 2.0**-140
    yield "fp32 extremes", torch.tensor([3.4028235e38, -3.4028235e38, 1e-45, -1e-45] * 50)
    yield "mixed scales", torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    # 127 in every 8 elements makes every block's scale exactly 1, so the halves between are ties: they must
    # round to even.
    halves = (torch.arange(-126, 126, dtype=torch.float32) + 0.5).view(-1, 7)
    yield "halves", torch.cat([halves, torch.full((36, 1), 127.0)], dim=1).reshape(-1).repeat(9)
    yield "several chunks", torch.randn((1 << 17) + 5, generator=g)


@needs_kernel
@pytest.mark.parametrize("isa", instruction_sets())
@pytest.mark.parametrize("block", [8, 13, 128, 1000, 65536])
def test_kernel_encodes_the_same_bytes_as_the_torch_path(block: int, isa: str) -> None:
    config = CodecConfig(block_size=block, min_compress_numel=0)
    for name, x in samples():
        with instruction_set(isa):
            kernel = encode(x, config)
        with blockwise.torch_path():
            reference = encode(x, config)
        assert kernel == reference, f"{name}: block {block}, {isa}"


@needs_kernel
@pytest.mark.parametrize("isa", instruction_sets())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 200_000, 200_037, (1 << 18) + 6])
def test_kernel_refuses_non_finite_input_anywhere(bad: float, where: int, isa: str) -> None:
    x = torch.randn((1 << 18) + 7)
    x[where] = bad
    for path in (blockwise.torch_path, lambda: instruction_set(isa)):
        with path(), pytest.raises(ValueError, match="NaN or Inf"):
            encode(x, CodecConfig())

"""Benchmark of peerd's 8-bit blockwise codec against hivemind's BlockwiseQuantization and a memcpy floor.

Usage: ``.venv/bin/python benchmarks/bench_codec.py [--numel 16777216] [--repeats 7] [--threads N]``

Everything is measured in one process on the same fp32 tensor (standard normal), median and minimum of
``--repeats`` runs after one warm-up (the minimum is the cost without interference from other load). Rows:

* peerd round trip = ``decode(encode(x))`` returning a fresh tensor, and with ``decode(..., out=buffer)``
  (a fresh 64 MB result costs page faults that a reused buffer does not: see the "fresh alloc + copy" row);
* hivemind round trip = ``BlockwiseQuantization.compress`` + ``extract`` (bitsandbytes, 4096-element blocks,
  dynamic 8-bit codebook). hivemind 1.1.12's ``extract`` calls ``int()`` on a 1-element numpy array, which
  numpy >= 2.4 rejects; :func:`_hivemind_extract` is the same code with ``[0]`` indexing, nothing else
  changed;
* torch path = the same encode and decode without the C kernel (fused torch passes, what a build without a C
  compiler runs; peerd.wire.blockwise);
* memcpy = ``dst.copy_(src)`` into a preallocated tensor: no codec can beat reading and writing the data once.

Then a block-size sweep of the peerd codec (bf16 scales), which is what the default block size rests on.
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from peerd.config import CodecConfig
from peerd.wire import blockwise
from peerd.wire.codec import decode, encode

PEER = "bench"
SWEEP_BLOCKS = (32, 64, 128, 256, 512, 1024)


def timings_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, minimum) wall time in ms; the minimum shows the cost without interference from other load."""
    fn()  # warm-up: first-touch of buffers, lazy imports, allocator growth
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


def _hivemind_extract(serialized: Any) -> torch.Tensor:
    """hivemind's BlockwiseQuantization.extract with numpy >= 2.4-compatible scalar reads."""
    from bitsandbytes.functional import dequantize_blockwise
    from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE, BlockwiseQuantization

    buffer, fp32 = serialized.buffer, BlockwiseQuantization.codebook_dtype
    absmax_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    codebook_size = int(np.frombuffer(buffer, offset=8, count=1, dtype=np.int64)[0])
    absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=fp32)
    codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=fp32)
    quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=np.uint8)
    result = dequantize_blockwise(
        torch.as_tensor(quantized).reshape(tuple(serialized.size)),
        absmax=torch.as_tensor(absmax),
        code=torch.as_tensor(codebook),
        blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE,
        nested=False,
    )
    return result.to(getattr(torch, serialized.dtype))


def hivemind_roundtrip() -> tuple[Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None, str]:
    try:
        import bitsandbytes.functional  # noqa: F401
        from hivemind.compression.base import CompressionInfo
        from hivemind.compression.quantization import BlockwiseQuantization
    except (ImportError, OSError, RuntimeError) as e:  # e.g. no bitsandbytes, or no native library for it
        return None, f"{type(e).__name__}: {e}"
    quantizer = BlockwiseQuantization()

    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        serialized = quantizer.compress(x, CompressionInfo.from_tensor(x))
        return _hivemind_extract(serialized), len(serialized.buffer)

    try:
        roundtrip(torch.randn(8192))
    except (RuntimeError, TypeError, ValueError, AttributeError, OSError) as e:  # a broken install
        return None, f"{type(e).__name__}: {e}"
    return roundtrip, ""


class Table:
    """Rows of (median ms, min ms, relative L2 error, payload bytes); the ratio column is against hivemind."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.rows: list[tuple[str, tuple[float, float] | None, float | None, int | None, str]] = []
        self.hivemind_ms: float | None = None

    def add(
        self, name: str, ms: tuple[float, float] | None, err: float | None, size: int | None, note: str = ""
    ) -> None:
        self.rows.append((name, ms, err, size, note))

    def ratio(self, name: str, prefix: str) -> float:
        """Median time of the row ``name`` over that of the first row starting with ``prefix``."""
        times = {row[0]: row[1][0] for row in self.rows if row[1] is not None}
        return times[name] / next(ms for row, ms in times.items() if row.startswith(prefix))

    def print(self) -> None:
        gb = self.numel * 4 / 1e9
        print(
            f"\n{'':32} {'median ms':>9} {'min ms':>8} {'GB/s':>6} {'t/hivemind':>10} {'rel L2 err':>10} "
            f"{'bytes/elt':>9}"
        )
        for name, ms, err, size, note in self.rows:
            if ms is None:
                print(f"{name:32} {note}")
                continue
            ratio = f"{ms[0] / self.hivemind_ms:.3f}" if self.hivemind_ms else "-"
            err_s = f"{err:.3e}" if err is not None else "-"
            bpe = f"{size / self.numel:.4f}" if size is not None else "-"
            print(
                f"{name:32} {ms[0]:9.2f} {ms[1]:8.2f} {gb / (ms[0] / 1e3):6.1f} {ratio:>10} {err_s:>10} "
                f"{bpe:>9}"
            )


def block_sweep(x: torch.Tensor, heavy: torch.Tensor, repeats: int) -> None:
    numel, out = x.numel(), torch.empty_like(x)
    print("\nblock-size sweep (bf16 scales; round trip with decode out=; heavy = Student-t with 3 dof):")
    print(
        f"{'block':>6} {'bytes/elt':>10} {'fp32 scales':>12} {'rel err normal':>15} {'rel err heavy':>14} "
        f"{'median ms':>10} {'min ms':>8}"
    )
    for block in SWEEP_BLOCKS:
        config = CodecConfig(block_size=block)
        payload = encode(x, config)

        def roundtrip(config: CodecConfig = config) -> object:
            return decode(encode(x, config), peer_id=PEER, out=out)

        median, fastest = timings_ms(roundtrip, repeats)
        err_heavy = rel_l2(heavy, decode(encode(heavy, config), peer_id=PEER))
        fp32_scales = (len(payload) + 2 * math.ceil(numel / block)) / numel
        print(
            f"{block:>6} {len(payload) / numel:>10.4f} {fp32_scales:>12.4f} "
            f"{rel_l2(x, decode(payload, peer_id=PEER)):>15.3e} {err_heavy:>14.3e} "
            f"{median:>10.2f} {fastest:>8.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="elements of the fp32 test tensor")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per row (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--block-size", type=int, default=128, help="peerd block size of the main table")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    numel, repeats = args.numel, args.repeats
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    heavy = torch.distributions.StudentT(3.0).sample((numel,)).float()
    config = CodecConfig(block_size=args.block_size)
    print(
        f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, numel = {numel} "
        f"({numel * 4 / 2**20:.0f} MiB fp32), repeats = {repeats}, peerd block size = {args.block_size}"
    )

    payload = encode(x, config)
    error, size = rel_l2(x, decode(payload, peer_id=PEER)), len(payload)
    heavy_errors = {"peerd": rel_l2(heavy, decode(encode(heavy, config), peer_id=PEER))}
    out, dst = torch.empty_like(x), torch.empty_like(x)

    def roundtrip() -> object:
        return decode(encode(x, config), peer_id=PEER)

    def roundtrip_out() -> object:
        return decode(encode(x, config), peer_id=PEER, out=out)

    table = Table(numel)
    hivemind, reason = hivemind_roundtrip()
    if hivemind is None:
        table.add("hivemind BlockwiseQuantization", None, None, None, f"unavailable: {reason}")
    else:
        y_hm, size_hm = hivemind(x)
        hivemind_ms = timings_ms(lambda: hivemind(x), repeats)
        table.hivemind_ms = hivemind_ms[0]
        table.add("hivemind BlockwiseQuantization", hivemind_ms, rel_l2(x, y_hm), size_hm)
        heavy_errors["hivemind"] = rel_l2(heavy, hivemind(heavy)[0])
    table.add("peerd round trip (fresh result)", timings_ms(roundtrip, repeats), error, size)
    table.add("peerd round trip (decode out=)", timings_ms(roundtrip_out, repeats), error, size)
    table.add("  peerd encode", timings_ms(lambda: encode(x, config), repeats), None, size)
    table.add(
        "  peerd decode (fresh result)",
        timings_ms(lambda: decode(payload, peer_id=PEER), repeats),
        None,
        None,
    )
    table.add(
        "  peerd decode (out=)",
        timings_ms(lambda: decode(payload, peer_id=PEER, out=out), repeats),
        None,
        None,
    )
    with blockwise.torch_path():  # the same arithmetic as fused torch passes: what runs without the C kernel
        table.add("  torch path: encode", timings_ms(lambda: encode(x, config), repeats), None, size)
        table.add(
            "  torch path: decode (out=)",
            timings_ms(lambda: decode(payload, peer_id=PEER, out=out), repeats),
            None,
            None,
        )
    sparse = CodecConfig(block_size=args.block_size, scheme="topk", density=0.0156, value_bits=2)
    sparse_payload = encode(x, sparse)
    sparse_error = rel_l2(x, decode(sparse_payload, peer_id=PEER, expected_shape=x.shape))
    table.add("  top-k 1.56%, 2-bit: encode", timings_ms(lambda: encode(x, sparse), repeats), sparse_error,
              len(sparse_payload))
    table.add(
        "  top-k 1.56%, 2-bit: decode (out=)",
        timings_ms(lambda: decode(sparse_payload, peer_id=PEER, out=out), repeats),
        None,
        None,
    )
    table.add("memcpy dst.copy_(src) (floor)", timings_ms(lambda: dst.copy_(x), repeats), 0.0, numel * 4)
    table.add("fresh alloc + copy: x.clone()", timings_ms(lambda: x.clone(), repeats), 0.0, numel * 4)
    table.print()
    print(f"encode (kernel: {blockwise.kernel()}) / memcpy = {table.ratio('  peerd encode', 'memcpy'):.2f}")
    print(
        "rel L2 err on heavy-tailed data (Student-t, 3 dof): "
        + ", ".join(f"{name} {err:.3e}" for name, err in heavy_errors.items())
    )
    block_sweep(x, heavy, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of peerd's 8-bit blockwise codec against hivemind's BlockwiseQuantization and a memcpy floor.

Usage: ``.venv/bin/python benchmarks/bench_codec.py [--numel 16777216] [--repeats 7] [--threads N]``

Everything is measured in one process on the same fp32 tensor (standard normal), median of ``--repeats`` runs
after one warm-up. Rows:

* peerd round trip = ``decode(encode(x))`` returning a fresh tensor, and with ``decode(..., out=buffer)``
  (a fresh 64 MB result costs page faults that a reused buffer does not: see the "fresh alloc + copy" row);
* hivemind round trip = ``BlockwiseQuantization.compress`` + ``extract`` (bitsandbytes, 4096-element blocks,
  dynamic 8-bit codebook). hivemind 1.1.12's ``extract`` calls ``int()`` on a 1-element numpy array, which
  numpy >= 2.4 rejects; :func:`_hivemind_extract` is the same code with ``[0]`` indexing, nothing else changed;
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peerd.averaging.codec import decode, encode  # noqa: E402
from peerd.config import CodecConfig  # noqa: E402

PEER = "bench"
SWEEP_BLOCKS = (32, 64, 128, 256, 512, 1024)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch of buffers, lazy imports, allocator growth
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


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
    except Exception as e:  # any import failure means "unavailable", with the reason printed
        return None, f"{type(e).__name__}: {e}"
    quantizer = BlockwiseQuantization()

    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        serialized = quantizer.compress(x, CompressionInfo.from_tensor(x))
        return _hivemind_extract(serialized), len(serialized.buffer)

    try:
        roundtrip(torch.randn(8192))
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return roundtrip, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="elements of the fp32 test tensor")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per row (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--block-size", type=int, default=128, help="peerd block size for the main table")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    numel, repeats = args.numel, args.repeats
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    gb = numel * 4 / 1e9
    config = CodecConfig(block_size=args.block_size)
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, numel = {numel} "
          f"({numel * 4 / 2**20:.0f} MiB fp32), repeats = {repeats}, peerd block size = {args.block_size}")

    rows: list[tuple[str, float | None, float | None, int | None, str]] = []
    payload = encode(x, config)
    y = decode(payload, peer_id=PEER)
    out = torch.empty_like(x)
    error, size = rel_l2(x, y), len(payload)
    rows.append(("peerd round trip (fresh result)", median_ms(lambda: decode(encode(x, config), peer_id=PEER), repeats), error, size, ""))
    rows.append(("peerd round trip (decode out=)", median_ms(lambda: decode(encode(x, config), peer_id=PEER, out=out), repeats), error, size, ""))
    rows.append(("  peerd encode", median_ms(lambda: encode(x, config), repeats), None, size, ""))
    rows.append(("  peerd decode (fresh result)", median_ms(lambda: decode(payload, peer_id=PEER), repeats), None, None, ""))
    rows.append(("  peerd decode (out=)", median_ms(lambda: decode(payload, peer_id=PEER, out=out), repeats), None, None, ""))

    hivemind, reason = hivemind_roundtrip()
    hivemind_ms = None
    if hivemind is None:
        rows.append(("hivemind BlockwiseQuantization", None, None, None, f"unavailable: {reason}"))
    else:
        y_hm, size_hm = hivemind(x)
        hivemind_ms = median_ms(lambda: hivemind(x), repeats)
        rows.append(("hivemind BlockwiseQuantization", hivemind_ms, rel_l2(x, y_hm), size_hm, ""))

    dst = torch.empty_like(x)
    rows.append(("memcpy dst.copy_(src) (floor)", median_ms(lambda: dst.copy_(x), repeats), 0.0, numel * 4, ""))
    rows.append(("fresh alloc + copy (x.clone())", median_ms(lambda: x.clone(), repeats), 0.0, numel * 4, ""))

    print(f"\n{'':33} {'time ms':>9} {'GB/s':>7} {'t/hivemind':>10} {'rel L2 err':>11} {'bytes/elt':>10}")
    for name, ms, err, nbytes, note in rows:
        if ms is None:
            print(f"{name:33} {note}")
            continue
        ratio = f"{ms / hivemind_ms:.3f}" if hivemind_ms else "-"
        err_s = f"{err:.3e}" if err is not None else "-"
        bpe = f"{nbytes / numel:.4f}" if nbytes is not None else "-"
        print(f"{name:33} {ms:9.2f} {gb / (ms / 1e3):7.1f} {ratio:>10} {err_s:>11} {bpe:>10}")

    heavy = torch.distributions.StudentT(3.0).sample((numel,)).float()
    print(f"\nblock-size sweep (bf16 scales; round trip with decode out=; heavy = Student-t, 3 dof):")
    print(f"{'block':>6} {'bytes/elt':>10} {'(fp32 scales)':>14} {'rel err normal':>15} {'rel err heavy':>14} {'round trip ms':>14}")
    for block in SWEEP_BLOCKS:
        cfg = CodecConfig(block_size=block)
        payload = encode(x, cfg)
        ms = median_ms(lambda: decode(encode(x, cfg), peer_id=PEER, out=out), repeats)
        err_heavy = rel_l2(heavy, decode(encode(heavy, cfg), peer_id=PEER))
        nblocks = math.ceil(numel / block)
        print(f"{block:>6} {len(payload) / numel:>10.4f} {(len(payload) + 2 * nblocks) / numel:>14.4f} "
              f"{rel_l2(x, decode(payload, peer_id=PEER)):>15.3e} {err_heavy:>14.3e} {ms:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a member's CPU goes when it verifies a round: each piece of verified reductions timed alone, in this
process, on one thread, for one member of a round of ``--numel`` fp32 among ``--members`` peers with the default
chunk (2^19 elements) and codec (8-bit blocks of 128), under the robust default (centered_clip).

Per round a member projects its own row in every span (its samples' sketch: 16 projections of every element),
hashes every payload it seals, receives, signs or applies, checks the span of every other reducer (a span's chunks
together), reads every other member's samples, takes the block norms and envelopes of its rows and of the
averages, and now and then audits a chunk (2% of the spans it applies). The table gives each piece's milliseconds
per round and the sum, which ``bench_allreduce.py --baseline`` sees as CPU per peer on an otherwise idle core;
when the peers share the cores (its loopback rows), every piece takes about twice as long.

Run: .venv/bin/python benchmarks/bench_verification.py [--numel 16777216] [--members 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.unit.verified_chunks

from peerd.averaging.layout import chunk_bounds
from peerd.averaging.verify.checks import check_chunks
from peerd.averaging.verify.disputes import judge_chunk
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.payloads import block_norms, envelope, view
from peerd.averaging.verify.samples import OwnRow, parse_samples, row_samples, sign_samples
from peerd.config import AveragingConfig, CodecConfig
from peerd.tables import format_table
from tests.unit.verified_chunks import Chunks, Span

CHUNK = AveragingConfig().chunk_numel
AUDIT = AveragingConfig().verification.audit_probability


def timed(repeats: int, work: Callable[[], object]) -> float:
    """Median milliseconds of ``work`` over ``repeats`` runs, after one to warm up."""
    work()
    runs = []
    for _ in range(repeats):
        started = time.process_time()
        work()
        runs.append(time.process_time() - started)
    return 1000 * statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, span_numel = args.members, args.numel // args.members
    chunks_per_span = len(chunk_bounds(span_numel, CHUNK))
    generator = torch.Generator().manual_seed(0)
    # one span's chunks reduced as a reducer does (Span: one chunk each), then stated and sampled together
    parts = [Span(torch.randn(CHUNK, generator=generator) + 0.5 * torch.randn(n, CHUNK, generator=generator),
                  codec=CodecConfig(min_compress_numel=0), seed=bytes(32)) for _ in range(chunks_per_span)]
    span = Chunks(parts)
    statement, samples = span.statement(), span.samples()
    outs, payloads = [p.out for p in parts], [view(p.out_payload) for p in parts]
    indices = list(range(len(parts)))
    block = parts[0].config.codec.block_size
    norms = [block_norms(out, block) for out in outs]
    # this member's own row in every span, as its exchanges leave it (decoded, with envelopes and block norms)
    row = torch.cat([p.decoded[1] for p in parts])
    bounds = span.bounds
    own = OwnRow(row, bounds, [envelope(view(p.payloads[1]), p.decoded[1], block) for p in parts],
                 [block_norms(p.decoded[1], block) for p in parts])
    rows = dict.fromkeys(range(n), own)
    key = parts[0].signing[1]
    signed = sign_samples(key, row_samples(key, "bench", span.randomness, rows, True), {})
    member = span.group.members[1]
    payload = parts[0].payloads[1]
    raw = bytes(4 * CHUNK)  # a reducer's own row is bound as a lossless payload
    chunks_total = n * chunks_per_span
    received = (n - 1) * chunks_per_span  # rows a reducer receives, averages a member receives
    pieces = [
        ("sketch of its own row in a span", n,
         lambda: [span.randomness.sketch(0, i, row[a:b]) for i, (a, b) in enumerate(bounds)]),
        ("the rest of its samples (values, envelopes, norms)", 1,
         lambda: sign_samples(key, row_samples(key, "bench", span.randomness, rows, False), {})),
        ("checks of the other reducers' spans", n - 1,  # the averages' block norms are taken as they come
         lambda: check_chunks(statement, indices, samples, outs, payloads, span.randomness, span.config,
                              [0] * len(indices), norms)),
        ("reading the other members' samples", n - 1,
         lambda: parse_samples(signed, member, "bench", span.randomness.seed, {s: bounds for s in range(n)},
                               block, KeyBook())),
        ("hashes: its sealed chunks, received rows and averages", 1,
         lambda: [blake3.blake3(payload).digest() for _ in range(chunks_total - chunks_per_span + 2 * received)]),
        ("hashes: its own row as a lossless payload, its signed averages", 1,
         lambda: [blake3.blake3(raw).digest() for _ in range(chunks_per_span)] +
         [blake3.blake3(payload).digest() for _ in range(chunks_per_span)]),
        ("block norms of its rows and the averages, its own row's envelope", 1,
         lambda: [block_norms(row[a:b], block) for _ in range(n) for a, b in bounds] +
         [block_norms(out, block) for _ in range(n - 1) for out in outs] +
         [envelope(None, row[a:b], block) for a, b in bounds]),
        ("signatures: seals, statement, averages, samples", 1,
         lambda: [key.sign(b"bench", payload[:64]) for _ in range(n + chunks_per_span + 1)]),
        ("audits (a chunk's rows recomputed exactly)", AUDIT * (n - 1),
         lambda: judge_chunk(parts[0].statement(), 0, span.group, {r: parts[0].payloads[r] for r in range(n)},
                             parts[0].out_payload, parts[0].all_samples(), parts[0].config, KeyBook())),
    ]
    table, total = [], 0.0
    for name, times, work in pieces:
        each = timed(args.repeats, work)
        total += each * times
        table.append([name, f"{each:.2f}", f"{times:g}", f"{each * times:.1f}"])
    table.append(["total per round", "", "", f"{total:.1f}"])
    print(f"one member of a round of {args.numel:,} fp32 among {n} peers ({chunks_per_span} chunks of {CHUNK:,} "
          f"a span), one thread, load {os.getloadavg()[0]:.1f}")
    print(format_table(["piece", "ms each", "times a round", "ms a round"], table))


if __name__ == "__main__":
    main()

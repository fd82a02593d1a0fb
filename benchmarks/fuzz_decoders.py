"""Fuzzes every decoder a peer's bytes reach, >= 100,000 cases each, and prints crashes, hangs and memory.

Run: .venv/bin/python benchmarks/fuzz_decoders.py [--cases 100000] [--only codec,frames] [--jobs 2]
     [--engine mutate|hypothesis] [--seed 1]

The decoders and their properties are tests/unit/fuzz_targets.py (also run, CI-sized, by tests/unit/test_fuzz.py).
Each decoder runs in its own process, so its max RSS is its own. Engines:

- ``mutate`` (default): a corpus of ``--corpus`` inputs drawn from the target's hypothesis strategy (valid
  inputs with and without structured mutations, and arbitrary bytes/values), then ``--cases`` cases that each
  take a corpus entry and apply 1-4 random mutations (bit flips, boundary integers over aligned 2/4/8-byte
  fields, truncation, insertion, deletion, splicing in bytes; fields replaced, dropped or added in records;
  elements swapped between entries), or are fresh random bytes. About 20x faster than hypothesis per case.
- ``hypothesis``: ``--cases`` examples straight from the strategy (generate phase only, no shrinking).

Per case: a crash is any exception the decoder does not document (listed with a reproducer); a hang is a case
still running after ``--case-timeout`` seconds (SIGALRM; a hang inside C code is caught when it returns, and
the whole decoder is stopped by a watchdog at ``--case-timeout`` x 20); memory is the growth of the process's
peak RSS during one case, flagged above ``--memory-limit`` MiB (a decoder allocating for a claimed length).
Exits 1 if any decoder had a crash, a hang or a memory finding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.unit.fuzz_targets

SPECIAL_FLOATS = [0.0, -0.0, 1e-45, -1.0, 1e308, math.inf, -math.inf, math.nan]


class Hang(BaseException):
    """Raised by SIGALRM inside a case; a BaseException so that no decoder's ``except Exception`` eats it."""


def _alarm(signum: int, frame: object) -> None:
    raise Hang()


class Mutator:
    def __init__(self, rng: random.Random, corpus: list[Any]) -> None:
        from tests.unit.fuzz_targets import BOUNDARY_INTS, _mutate

        self.rng, self.corpus, self.ints, self.mutate_bytes = rng, corpus, BOUNDARY_INTS, _mutate

    def case(self) -> Any:
        value = self.rng.choice(self.corpus)
        for _ in range(self.rng.randint(1, 4)):
            value = self.mutate(value, top=True)
        return value

    def random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.choice([0, 1, 7, 8, 16, 24, 64, 512]))

    def mutate(self, value: Any, top: bool = False) -> Any:
        rng = self.rng
        if isinstance(value, (bytes, bytearray)):
            if rng.random() < 0.05:
                return self.random_bytes()
            data = bytearray(value)
            op = rng.choice(["flip", "byte", "u64", "u32", "u16", "truncate", "insert", "delete", "splice"])
            number = rng.choice(self.ints) if rng.random() < 0.7 else rng.getrandbits(64)
            self.mutate_bytes(data, op, rng.random(), number, rng.randbytes(rng.randint(0, 16)))
            return bytes(data)
        if isinstance(value, tuple):
            if not value:
                return value
            i = rng.randrange(len(value))
            other = rng.choice(self.corpus)
            # top-level tuples carry the case's parameters (which side, which limit): swap those in from
            # another entry, mutate only the data
            if top and isinstance(other, tuple) and len(other) == len(value) and rng.random() < 0.3:
                return value[:i] + (other[i],) + value[i + 1 :]
            if top and not isinstance(value[i], (bytes, bytearray, dict, list, tuple, str)):
                return value
            return value[:i] + (self.mutate(value[i]),) + value[i + 1 :]
        if isinstance(value, dict):
            record = dict(value)
            roll = rng.random()
            if record and roll < 0.5:
                key = rng.choice(list(record))
                record[key] = self.mutate(record[key]) if rng.random() < 0.6 else self.scalar()
            elif record and roll < 0.75:
                del record[rng.choice(list(record))]
            else:
                record[rng.choice(["x", "peer_id", "t", "step", "groups", ""])] = self.scalar()
            return record
        if isinstance(value, list):
            items = list(value)
            roll = rng.random()
            if items and roll < 0.5:
                i = rng.randrange(len(items))
                items[i] = self.mutate(items[i])
            elif items and roll < 0.7:
                del items[rng.randrange(len(items))]
            elif roll < 0.85:  # lists of byte strings (payloads) stay lists of byte strings
                items.append(self.scalar() if not items else self.mutate(rng.choice(items)))
            elif len(items) <= 16:  # past length limits; bounded, so a case's time follows its decoder
                items = items * rng.choice([2, 70])
            return items
        if isinstance(value, str):
            if not value or rng.random() < 0.3:
                return rng.choice(["", "\x00", "é" * 300, value * 2, str(rng.getrandbits(64))])
            i = rng.randrange(len(value))
            return value[:i] + chr(rng.randrange(0x20, 0x250)) + value[i + 1 :]
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return rng.choice([-value, value + 1, value - 1, *self.ints, -(2**63), 2**64])
        if isinstance(value, float):
            return rng.choice(SPECIAL_FLOATS + [value * 1e300, -value])
        return self.scalar()

    def scalar(self) -> Any:
        rng = self.rng
        return rng.choice([None, True, 0, -1, 2**64, rng.getrandbits(70) - 2**69, rng.choice(SPECIAL_FLOATS),
                           "", "x" * 300, rng.randbytes(8), [], {}, [None], {"a": 1}])


def corpus_of(target: Any, size: int, seed: int) -> list[Any]:
    from hypothesis import HealthCheck, Phase, given, settings

    corpus: list[Any] = []

    @settings(max_examples=size, phases=[Phase.generate], database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(target.inputs)
    def collect(value: Any) -> None:
        corpus.append(value)

    collect()
    return corpus


def worker(name: str, cases: int, engine: str, corpus_size: int, seed: int, case_timeout: float,
           memory_limit: float, max_reports: int) -> dict[str, Any]:
    import torch

    from tests.unit.fuzz_targets import TARGETS

    torch.set_num_threads(1)
    target = next(t for t in TARGETS if t.name == name)
    signal.signal(signal.SIGALRM, _alarm)
    crashes: dict[str, dict[str, Any]] = {}
    hangs: list[str] = []
    memory: list[str] = []
    outcomes = {"ok": 0, "refused": 0}
    worst = {"seconds": 0.0, "rss_growth_mib": 0.0}
    started = time.monotonic()

    def one(value: Any) -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        case_start = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, case_timeout)
        try:
            target.run(value)
            outcomes["ok"] += 1
        except target.errors:
            outcomes["refused"] += 1
        except Hang:
            hangs.append(repr(value)[:400])
        except BaseException as e:  # noqa: BLE001 - the finding: any other exception is a crash
            key = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            entry = crashes.setdefault(key, {"count": 0, "reproducer": repr(value)[:2000],
                                              "traceback": traceback.format_exc()[-1500:]})
            entry["count"] += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = time.perf_counter() - case_start
        growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        worst["seconds"] = max(worst["seconds"], seconds)
        worst["rss_growth_mib"] = max(worst["rss_growth_mib"], growth)
        if growth > memory_limit and len(memory) < max_reports:
            memory.append(f"{growth:.0f} MiB: {repr(value)[:400]}")

    if engine == "hypothesis":
        from hypothesis import HealthCheck, Phase, given, settings

        @settings(max_examples=cases, phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(target.inputs)
        def run(value: Any) -> None:
            one(value)

        run()
    else:
        corpus = corpus_of(target, corpus_size, seed)
        for value in corpus:
            one(value)
        mutator = Mutator(random.Random(f"{seed}/{name}"), corpus)
        for _ in range(cases):
            one(mutator.case() if mutator.rng.random() < 0.9 else mutator.random_bytes_case())
    return {
        "decoder": name, "cases": outcomes["ok"] + outcomes["refused"] + len(hangs) + sum(
            c["count"] for c in crashes.values()), **outcomes,
        "crashes": crashes, "hangs": hangs, "memory": memory, "seconds": round(time.monotonic() - started, 1),
        "slowest_case_s": round(worst["seconds"], 4), "max_case_rss_growth_mib": round(worst["rss_growth_mib"], 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _random_bytes_case(self: Mutator) -> Any:
    """A case whose data (every bytes field of the entry) is fresh random bytes."""
    value = self.rng.choice(self.corpus)
    if isinstance(value, (bytes, bytearray)):
        return self.random_bytes()
    if isinstance(value, tuple):
        return tuple(self.random_bytes() if isinstance(v, (bytes, bytearray)) else v for v in value)
    return self.mutate(value)


Mutator.random_bytes_case = _random_bytes_case  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100_000, help="cases per decoder (after the corpus)")
    parser.add_argument("--only", default="", help="comma-separated decoder names (default: all)")
    parser.add_argument("--engine", choices=["mutate", "hypothesis"], default="mutate")
    parser.add_argument("--corpus", type=int, default=300, help="corpus entries drawn from the strategy (mutate)")
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case-timeout", type=float, default=2.0, help="a case running longer is a hang")
    parser.add_argument("--memory-limit", type=float, default=256.0, help="MiB of peak-RSS growth in one case")
    parser.add_argument("--json", type=Path, help="also write the full results (reproducers included) here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = worker(args.worker, args.cases, args.engine, args.corpus, args.seed, args.case_timeout,
                        args.memory_limit, 5)
        print(json.dumps(result))
        return 0

    from tests.unit.fuzz_targets import TARGETS

    names = [t.name for t in TARGETS if not args.only or t.name in args.only.split(",")]
    print(f"fuzzing {len(names)} decoders, {args.cases} cases each ({args.engine}), {args.jobs} jobs; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    pending, running, results = list(names), {}, []
    watchdog = args.case_timeout * 20
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            cmd = [sys.executable, __file__, "--worker", name, "--cases", str(args.cases), "--engine", args.engine,
                   "--corpus", str(args.corpus), "--seed", str(args.seed), "--case-timeout", str(args.case_timeout),
                   "--memory-limit", str(args.memory_limit)]
            out = Path(os.devnull)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(out, "w"), text=True)  # noqa: SIM115
            running[name] = (proc, time.monotonic())
        time.sleep(0.2)  # polling child processes
        for name, (proc, began) in list(running.items()):
            if proc.poll() is None:
                # no progress report from inside a worker; its budget is generous: cases x the slowest sane case
                if time.monotonic() - began > max(3600.0, watchdog):
                    proc.kill()
                    proc.wait()
                else:
                    continue
            del running[name]
            stdout = proc.stdout.read() if proc.stdout else ""
            try:
                result = json.loads(stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                result = {"decoder": name, "cases": 0, "crashes": {f"worker died (code {proc.returncode})": {
                    "count": 1, "reproducer": "", "traceback": stdout[-1500:]}}, "hangs": [], "memory": [],
                    "seconds": round(time.monotonic() - began, 1), "max_rss_mib": math.nan}
            results.append(result)
            print(line(result), flush=True)

    print("\ndecoder              cases  refused       ok  crashes  hangs  mem  slowest_s  max_rss_mib  time_s")
    for r in sorted(results, key=lambda r: names.index(r["decoder"])):
        print(line(r))
    for r in results:
        for key, crash in r["crashes"].items():
            print(f"\nCRASH in {r['decoder']} ({crash['count']}x): {key}\n  reproducer: {crash['reproducer'][:600]}"
                  f"\n{crash['traceback']}")
        for hang in r["hangs"][:5]:
            print(f"\nHANG in {r['decoder']}: {hang}")
        for finding in r["memory"]:
            print(f"\nMEMORY in {r['decoder']}: {finding}")
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    bad = any(r["crashes"] or r["hangs"] or r["memory"] for r in results)
    print("RESULT:", "FAIL" if bad else "OK")
    return 1 if bad else 0


def line(r: dict[str, Any]) -> str:
    crashes = sum(c["count"] for c in r["crashes"].values())
    return (f"{r['decoder']:18s} {r['cases']:8d} {r.get('refused', 0):8d} {r.get('ok', 0):8d} {crashes:8d} "
            f"{len(r['hangs']):6d} {len(r['memory']):4d} {r.get('slowest_case_s', math.nan):10.3f} "
            f"{r['max_rss_mib']:12.1f} {r['seconds']:7.1f}")


if __name__ == "__main__":
    sys.exit(main())

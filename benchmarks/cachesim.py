"""The API server's per-request work as a CPU simulator counts it, for `server_overhead.py --part api`'s
variants (issue 24): instructions, first-level instruction and data cache misses and last-level misses
per request above bare, from valgrind's callgrind (Debian package `valgrind`) with this machine's L1 and
L2 caches simulated (L2 as the last level: a core's own).

The timed figures of `--part api` move by tens of microseconds between runs on a shared VM; these counts
do not (two runs agree within about 1%), so they tell what a change did to the work and to its memory
traffic where a timed run cannot. They count user space only, every thread (native tracing's span
export on the SDK's worker thread included), and nothing of the kernel. Under callgrind the process runs
about 50 times slower, so work that happens per second (timers, the fsync thread) weighs more per
request here than in the timed runs.

    .venv/bin/python benchmarks/cachesim.py                      # bare, default, no HTTP span, native
    .venv/bin/python benchmarks/cachesim.py --variants default,floor,http-only --requests 60

Native tracing's batch processor exports a run's spans in one batch at the flush that ends the run, as
in `--part api` (its timer is set past the run here: a run takes minutes under callgrind); the batch's
fixed cost is spread over `--requests` here against 300 there. The metric reader's export, timed apart
in `--part api`, does not run here (its interval is set past the runs too).

The engine's outputs are recorded once from the real engine (not under valgrind) and replayed, as in
`--part api`. About 10 minutes for the default four variants at 40 requests each.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

VARIANTS = {  # short name -> server_overhead's variant constant
    "default": "API_DEFAULT",
    "no-http": "API_NO_HTTP",
    "native": "API_NATIVE",
    "fastapi": "API_FASTAPI",
    "aa": "API_AA",
    "http-only": "API_HTTP_ONLY",
    "floor": "API_FLOOR",
}
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")  # callgrind's, with --cache-sim


def machine_caches() -> list[str]:
    """valgrind's cache options for this CPU's L1 instruction and data caches and its L2 (as the last
    level), from sysfs; none where a cache is not described or not simulable (sets not a power of two)."""
    options = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = int((index / "size").read_text().strip().rstrip("K")) * 1024
            ways = int((index / "ways_of_associativity").read_text())
            line = int((index / "coherency_line_size").read_text())
        except (OSError, ValueError):
            continue
        sets = size // max(1, ways * line)
        if sets < 1 or sets & (sets - 1):
            continue
        name = {(1, "Instruction"): "--I1", (1, "Data"): "--D1", (2, "Unified"): "--LL"}.get((level, kind))
        if name:
            options[name] = f"{name}={size},{ways},{line}"
    return list(options.values())


def inner(directory: Path, variants: list[str], requests: int, warm: int, rounds: int, max_tokens: int) -> None:
    """Under callgrind: part_api's loads, each run's timed requests between two dumps."""
    import server_overhead as so
    from opentelemetry import trace

    with open(directory / "traffic.pkl", "rb") as f:
        added, batches, tokenizer = pickle.load(f)
    so.record_engine_traffic = lambda n, max_tokens: (added, batches, tokenizer, sum(len(o) for o, _ in batches))
    chosen = [getattr(so, VARIANTS[v]) for v in variants]
    so.API_VARIANTS = (so.API_BARE, *[v for v in chosen if v not in (so.API_HTTP_ONLY, so.API_FLOOR)])
    so.API_LAYERS = tuple(v for v in chosen if v == so.API_HTTP_ONLY)
    so.API_FLOORS = tuple(v for v in chosen if v == so.API_FLOOR)
    so.API_WARM = warm
    # native tracing's batch processor exports at the flush that ends each run only, as in --part api's
    # runs (300 requests take well under its default 5 s there, and minutes under callgrind)
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = str(3_600_000)
    # and no metric export inside a run: it is timed apart there (once a minute, minutes here)
    so.API_METRIC_INTERVAL_MS = 3_600_000
    # and the export channel's held messages go as they do there (every 16 requests, when the run waits for
    # the export process, and at the run's end), not by the channel's timer: HOLD_S is wall time, and a
    # request that takes one millisecond there takes about fifty here
    from otel_llm.vllm.export import channel as export_channel

    export_channel.HOLD_S = 3600.0
    pid = str(os.getpid())
    regions = open(directory / "regions.txt", "w")
    calls = []

    def measured(label: str, stream: bool, phase: str) -> None:
        if phase == "start":
            # the warm-up requests' spans exported now (the run's flush exports the run's own), and the garbage
            # collected: each run starts from the same heap, and no full collection of the process's millions
            # of objects (vLLM, torch) falls into one run and not another
            trace.get_tracer_provider().force_flush()
            gc.collect()
        if not calls:
            subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True)
        calls.append(label)
        # dump k (numbered from 1) holds what ran since the dump before: at "sent", a run's requests; at
        # "flushed", the tracer provider's flush after them (native tracing's span export)
        subprocess.run(["callgrind_control", "-d", pid], capture_output=True)
        regions.write(f"{len(calls)}\t{label}\t{stream}\t{phase}\n")
        regions.flush()

    try:
        so.part_api(
            rounds=rounds,
            requests=requests,
            max_tokens=max_tokens,
            layers=bool(so.API_LAYERS),
            floor=bool(so.API_FLOORS),
            measured=measured,
        )
    except Exception as exc:  # noqa: BLE001 - the report of a run with only some variants; the dumps are made
        print(f"(part_api's report: {type(exc).__name__}: {exc})")


def totals(path: Path) -> dict[str, int]:
    events, values = None, None
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            values = [int(v) for v in line.split()[1:]]
    return dict(zip(events or (), values or ()))


def report(directory: Path, requests: int, chunks: int) -> None:
    """Per request: a run's requests and the flush after them (native tracing's export of their spans,
    as --part api counts it) over `requests`."""
    runs: dict[tuple[str, bool, str], list[dict]] = {}
    for line in (directory / "regions.txt").read_text().splitlines():
        number, label, stream, phase = line.split("\t")
        dumps = list(directory.glob(f"callgrind.out.*.{number}"))
        if phase == "start" or not dumps:
            continue
        variant, round_number = label.rsplit(", round ", 1)
        if int(round_number) < 0:  # the warm-up round: first-use costs (imports, caches, connections)
            continue
        runs.setdefault((variant, stream == "True", phase), []).append(totals(dumps[0]))

    def mean(key) -> dict:
        rows = runs.get(key, [])
        return {e: sum(r.get(e, 0) for r in rows) / max(1, len(rows)) for e in EVENTS}

    per_request = {}
    for variant, stream, phase in runs:
        if phase == "sent":
            sent, flushed = mean((variant, stream, "sent")), mean((variant, stream, "flushed"))
            per_request[(variant, stream)] = {e: (sent[e] + flushed[e]) / requests for e in EVENTS}
    native_flush = {s: mean(("vLLM native tracing", s, "flushed")) for s in (False, True)}
    print(
        f"\nPer request above bare, simulated (callgrind; {requests} requests per run, the mean of the runs "
        "after the warm-up round; the tracer provider's flush after each run's requests included, as in "
        "--part api): instructions, L1 instruction misses, L1 data misses (read + write), last-level (L2) "
        "misses; over native tracing's in parentheses where it ran"
    )
    if any(native_flush[s]["Ir"] for s in native_flush):
        flush = native_flush[False]
        print(
            f"  of which native tracing's span export (one batch of {requests} spans per run, flushed): "
            f"{flush['Ir'] / requests:,.0f} instructions, {(flush['D1mr'] + flush['D1mw']) / requests:,.0f} L1 data "
            "misses per request"
        )
    for stream in (False, True):
        bare = per_request.get(("bare", stream))
        native = per_request.get(("vLLM native tracing", stream))
        if bare is None:
            continue
        print(f"  {f'stream ({chunks} chunks)' if stream else 'non-stream'}: bare {bare['Ir']:,.0f} instructions")
        for (variant, s), counts in sorted(per_request.items()):
            if s != stream or variant == "bare":
                continue
            row = []
            for name, events in (
                ("instructions", ("Ir",)),
                ("L1i misses", ("I1mr",)),
                ("L1d misses", ("D1mr", "D1mw")),
                ("L2 misses", ("ILmr", "DLmr", "DLmw")),
            ):
                added = sum(counts[e] - bare[e] for e in events)
                ratio = ""
                if native is not None and variant != "vLLM native tracing":
                    native_added = sum(native[e] - bare[e] for e in events)
                    ratio = f" ({added / native_added:.2f}x)" if native_added > 0 else ""
                row.append(f"{name} {added:+10,.0f}{ratio}")
            print(f"    {variant:28} " + "  ".join(row))
    if chunks > 1:  # the stream's per-chunk slope: (stream - non-stream, each above bare) over its chunks
        print(f"  per chunk (stream minus non-stream, each above bare, over {chunks} chunks)")
        for (variant, s), counts in sorted(per_request.items()):
            plain = per_request.get((variant, False))
            if not s or variant == "bare" or plain is None:
                continue
            row = []
            for name, events in (("instructions", ("Ir",)), ("L1d misses", ("D1mr", "D1mw"))):
                added = sum(
                    (counts[e] - per_request[("bare", True)][e]) - (plain[e] - per_request[("bare", False)][e])
                    for e in events
                )
                row.append(f"{name} {added / chunks:+9,.1f}")
            print(f"    {variant:28} " + "  ".join(row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="default,no-http,native", help=",".join(VARIANTS))
    parser.add_argument("--requests", type=int, default=40, help="timed requests per run")
    parser.add_argument("--warm", type=int, default=10, help="requests before each run's timed ones")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="output tokens per request: the stream's chunks (its slope per chunk)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds after the warm-up round (not counted)")
    parser.add_argument("--keep", action="store_true", help="keep callgrind's dumps (their directory is printed)")
    parser.add_argument("--inner", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.inner is not None:
        inner(args.inner, variants, args.requests, args.warm, args.rounds, args.max_tokens)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("cachesim: valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    import server_overhead as so

    (ROOT / ".cache").mkdir(exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="cachesim-", dir=ROOT / ".cache"))
    added, batches, tokenizer, _ = so.record_engine_traffic(1, args.max_tokens)  # the real engine, not under valgrind
    with open(directory / "traffic.pkl", "wb") as f:
        pickle.dump((added, batches, tokenizer), f)
    caches = machine_caches()
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--cache-sim=yes",
        *caches,
        f"--callgrind-out-file={directory}/callgrind.out.%p",
        sys.executable,
        str(Path(__file__).resolve()),
        "--inner",
        str(directory),
        "--variants",
        ",".join(variants),
        "--requests",
        str(args.requests),
        "--warm",
        str(args.warm),
        "--max-tokens",
        str(args.max_tokens),
        "--rounds",
        str(args.rounds),
    ]
    print(f"cachesim: {' '.join(caches) or 'valgrind default caches'}; dumps in {directory}")
    with open(directory / "inner.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=ROOT)
    report(directory, args.requests, args.max_tokens)
    if not args.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

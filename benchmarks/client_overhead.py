"""Client-side overhead of OpenAI client instrumentations, side by side in one run.

The real `openai` client (sync `OpenAI`, plus one `AsyncOpenAI` stream measurement) calls a
fake OpenAI-compatible server with fixed responses, running in another process so that its CPU
does not count. Each variant runs in a fresh subprocess (instrumentations patch globally):

    bare         no instrumentation
    bare-aa      bare again: an A/A pair that shows the method's spread
    sdk-floor    no instrumentation; each call wrapped in one span (15 attributes) and three
                 histogram records made with the SDK directly: the floor any of them pays
    otel-llm     otel_llm.openai.OpenAIInstrumentor (this repository)
    official     opentelemetry-instrumentation-genai-openai (on opentelemetry-util-genai)
    openai-v2    opentelemetry-instrumentation-openai-v2 (the deprecated contrib one)
    official+httpx  official plus HTTPX2ClientInstrumentor: what the official instrumentation needs
                 to put the trace context on the request (ours and OpenLLMetry's inject it themselves)
    openllmetry  opentelemetry-instrumentation-openai (Traceloop's OpenLLMetry)

Peers are installed by this script, each into its own `.cache/bench-peers/<variant>` directory
(`pip install --no-deps --target`, only what .venv lacks), never into .venv: they register
`opentelemetry_instrumentor` entry points named `openai` that every `opentelemetry-instrument`
process would load. That directory goes first on sys.path in that variant's subprocess only.

Every instrumented variant gets the same SDK setup: a TracerProvider whose BatchSpanProcessor
feeds an exporter that encodes spans to OTLP protobuf and discards the bytes (flushed at the end
of each timed block, so encoding counts), and a MeterProvider with an InMemoryMetricReader
(recording counts; collection, periodic in real life, does not). Message content capture is off
everywhere (the default; OpenLLMetry defaults to on, so TRACELOOP_TRACE_CONTENT=false for it).
No LoggerProvider is set: instrumentations that emit log events emit them to the no-op default.

All variants' processes start together and wait; the parent then runs them one at a time, a
short block each (16 chat calls, or 2 streams of K=1 or K=201 chunks, or 8 legacy completions),
variant after variant for one kind of call, the order reversed every round (ABBA ...), for up
to ~180 s. The measure is the client process's CPU time (time.process_time, all threads, so the
span processor's export thread counts too), wall time beside it. On a shared VM the CPU's speed
drifts by up to 2x within seconds; blocks of the same round see nearly the same speed, so each
round gives a ratio to bare, and the figures are medians of those ratios (± 1.58 IQR/sqrt(n), a
rough 95% interval), turned into microseconds with bare's median. Per chunk is
(t[K=201] - t[K=1]) / 200 per call, from the same round. The bare-aa row is the method's noise.
Spans are counted per kind of call: a variant that makes no spans is flagged as a broken
measurement, not ranked.

    python benchmarks/client_overhead.py [--seconds 180] [--variants bare,otel-llm,...] [--no-install]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = ROOT / ".cache" / "bench-peers"
MODEL = "gpt-4o-mini"
CHUNKS_HEADER = "x-bench-chunks"
SHORT, LONG = 1, 201  # content chunks per streamed response


@dataclass
class Variant:
    module: str | None = None  # instrumentor module; None: bare
    requirements: list[str] = field(default_factory=list)  # installed into .cache/bench-peers/<name>
    dists: list[str] = field(default_factory=list)  # versions to report
    env: dict[str, str] = field(default_factory=dict)
    floor: bool = False  # no instrumentation: the SDK alone makes the span and metrics (see worker)
    # also HTTPX2ClientInstrumentor: how the peers that do not inject the trace context themselves
    # get it onto the request (one more span per call)
    with_httpx: bool = False

    @property
    def instrumented(self) -> bool:
        return bool(self.module or self.floor)


VARIANTS = {
    "bare": Variant(),
    "bare-aa": Variant(),
    "sdk-floor": Variant(floor=True),
    "otel-llm": Variant("otel_llm.openai", dists=["otel-llm"]),
    "official": Variant(
        "opentelemetry.instrumentation.genai.openai",
        ["opentelemetry-instrumentation-genai-openai==1.3b0", "opentelemetry-util-genai==1.3b0"],
        ["opentelemetry-instrumentation-genai-openai", "opentelemetry-util-genai"],
    ),
    "openai-v2": Variant(
        "opentelemetry.instrumentation.openai_v2",
        # its util-genai floor (>=0.4b0) lets pip take 1.3b0, which no longer has the
        # `opentelemetry.util.genai.instruments` module 2.4b0 imports; 1.1b0 is the last with it
        ["opentelemetry-instrumentation-openai-v2==2.4b0", "opentelemetry-util-genai==1.1b0"],
        ["opentelemetry-instrumentation-openai-v2", "opentelemetry-util-genai"],
    ),
    "official+httpx": Variant(
        "opentelemetry.instrumentation.genai.openai",
        ["opentelemetry-instrumentation-genai-openai==1.3b0", "opentelemetry-util-genai==1.3b0"],
        ["opentelemetry-instrumentation-genai-openai", "opentelemetry-util-genai"],
        with_httpx=True,
    ),
    "openllmetry": Variant(
        "opentelemetry.instrumentation.openai",
        ["opentelemetry-instrumentation-openai==0.62.4", "opentelemetry-semantic-conventions-ai>=0.5.1,<0.6"],
        ["opentelemetry-instrumentation-openai", "opentelemetry-semantic-conventions-ai"],
        env={"TRACELOOP_TRACE_CONTENT": "false"},
    ),
}


# --- fake OpenAI-compatible server (own process) -------------------------------------------


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage() -> dict:
    return {
        "prompt_tokens": 22,
        "completion_tokens": 16,
        "total_tokens": 38,
        "prompt_tokens_details": {"cached_tokens": 8, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL,
            "system_fingerprint": "fp_bench",
            "service_tier": "default",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "logprobs": None,
                    "message": {"role": "assistant", "content": "Tracing shows where the time went.", "refusal": None},
                }
            ],
            "usage": _usage(),
        }
    ).encode()


def _chat_stream(k: int) -> bytes:
    def chunk(choices, usage=None):
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "system_fingerprint": "fp_bench",
            "service_tier": "default",
            "choices": choices,
            "usage": usage,
        }

    events = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": " tok", **({"role": "assistant"} if i == 0 else {})},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        for i in range(k)
    ]
    events.append(chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]))
    events.append(chunk([], _usage()))
    return b"".join(_sse(e) for e in events) + b"data: [DONE]\n\n"


def _completion() -> bytes:
    return json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1700000000,
            "model": MODEL,
            "system_fingerprint": "fp_bench",
            "choices": [{"index": 0, "text": " where the time went.", "finish_reason": "length", "logprobs": None}],
            "usage": _usage(),
        }
    ).encode()


def serve() -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    chat, completion, streams = _chat_completion(), _completion(), {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connection
        disable_nagle_algorithm = True  # headers and body are separate writes

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            path, status = self.path.split("?", 1)[0], 200
            if path.endswith("/chat/completions") and body.get("stream"):
                k = int(self.headers.get(CHUNKS_HEADER, 1))
                payload, ctype = streams.get(k) or streams.setdefault(k, _chat_stream(k)), "text/event-stream"
            elif path.endswith("/chat/completions"):
                payload, ctype = chat, "application/json"
            elif path.endswith("/completions"):
                payload, ctype = completion, "application/json"
            else:
                payload, ctype, status = b'{"error": {"message": "not found"}}', "application/json", 404
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()
    return 0


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}/v1"


# --- peers: own --target directories ------------------------------------------------------


def _pip(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _import_check(target: Path, module: str) -> str | None:
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import importlib; "
        f"m = importlib.import_module({module!r}); m.OpenAIInstrumentor"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


def ensure_peer(name: str, install: bool) -> str | None:
    """Install a peer into its own directory when missing; None when usable, else the reason."""
    spec = VARIANTS[name]
    if not spec.requirements:
        return None
    target = PEERS_DIR / name
    stamp = target / ".bench-requirements"
    wanted = "\n".join(spec.requirements)
    if stamp.exists() and stamp.read_text() == wanted:
        return None  # the worker's import tells if it still works
    if not install:
        return f"not installed in {target.relative_to(ROOT)} (--no-install)"
    print(f"installing {name} into {target.relative_to(ROOT)} ...", flush=True)
    try:
        # what pip would add to .venv for these requirements: only that goes into the target
        r = _pip("install", "--dry-run", "--quiet", "--report", "-", *spec.requirements)
        if r.returncode != 0:
            return "pip could not resolve: " + (r.stderr.strip().splitlines() or ["?"])[-1]
        report = json.loads(r.stdout)
        pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report["install"]]
        shutil.rmtree(target, ignore_errors=True)
        if pins:
            r = _pip("install", "--quiet", "--no-deps", "--no-compile", "--target", str(target), *pins)
            if r.returncode != 0:
                return "pip install failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
        target.mkdir(parents=True, exist_ok=True)
        print(f"  added: {', '.join(pins) or 'nothing (all in .venv)'}", flush=True)
    except (subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
        return f"install failed: {e!r}"
    problem = _import_check(target, spec.module)
    if problem:
        return f"installed but `import {spec.module}` fails: {problem}"
    stamp.write_text(wanted)
    return None


# --- worker: one variant, one fresh process, driven block by block over stdin -----------------


def worker(args) -> int:
    name = args.worker
    spec = VARIANTS[name]
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # protocol lines; stray prints go to stderr
    os.dup2(2, 1)
    if args.peer_dir:
        sys.path.insert(0, args.peer_dir)
    sys.path.insert(1 if args.peer_dir else 0, str(ROOT))
    import asyncio
    import importlib
    from importlib import metadata

    import openai

    tracer_provider = meter_provider = reader = None
    exported = {"spans": 0, "bytes": 0, "names": {}, "sample": {}}
    if spec.instrumented:
        try:
            instrumentor_cls = importlib.import_module(spec.module).OpenAIInstrumentor if spec.module else None
        except Exception as e:  # noqa: BLE001 - reported as a skip
            proto.write("SKIP " + json.dumps(f"import {spec.module} failed: {type(e).__name__}: {e}") + "\n")
            return 3
        from opentelemetry import metrics, trace
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        class EncodeAndDiscard(SpanExporter):
            def export(self, spans):
                exported["bytes"] += len(encode_spans(spans).SerializeToString())
                exported["spans"] += len(spans)
                for s in spans:
                    exported["names"][s.name] = exported["names"].get(s.name, 0) + 1
                    exported["sample"].setdefault(s.name, sorted(s.attributes or {}))
                return SpanExportResult.SUCCESS

        tracer_provider = TracerProvider()
        # a queue that never drops: a dropped span would be a span nobody paid to export
        tracer_provider.add_span_processor(
            BatchSpanProcessor(EncodeAndDiscard(), max_queue_size=1_000_000, schedule_delay_millis=600_000)
        )  # export at flush only
        reader = InMemoryMetricReader()
        meter_provider = MeterProvider(metric_readers=[reader])
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
        try:
            if instrumentor_cls:
                instrumentor_cls().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
            if spec.with_httpx:
                from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor

                HTTPX2ClientInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
        except Exception as e:  # noqa: BLE001
            proto.write("SKIP " + json.dumps(f"instrument() failed: {type(e).__name__}: {e}") + "\n")
            return 3

    client = openai.OpenAI(base_url=args.url, api_key="bench", max_retries=0)
    aclient = openai.AsyncOpenAI(base_url=args.url, api_key="bench", max_retries=0)
    loop = asyncio.new_event_loop()
    messages = [{"role": "user", "content": "tell me about tracing"}]

    def chat():
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.7)
        assert r.usage.prompt_tokens_details.cached_tokens == 8

    def stream(k):
        def call():
            n = 0
            for _ in client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={CHUNKS_HEADER: str(k)},
            ):
                n += 1
            assert n == k + 2, n

        return call

    def astream(k):
        async def one():
            n = 0
            async for _ in await aclient.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={CHUNKS_HEADER: str(k)},
            ):
                n += 1
            assert n == k + 2, n

        def call():  # one loop for the whole run, run_until_complete per call: the same for all
            loop.run_until_complete(one())

        return call

    def legacy():
        client.completions.create(model=MODEL, prompt="tell me about tracing", max_tokens=16)

    kinds = {
        "chat": chat,
        "stream1": stream(SHORT),
        f"stream{LONG}": stream(LONG),
        "astream1": astream(SHORT),
        f"astream{LONG}": astream(LONG),
        "legacy": legacy,
    }

    if spec.floor:
        kinds = sdk_floor(kinds, tracer_provider, meter_provider)

    def flush():
        if tracer_provider:
            tracer_provider.force_flush()

    try:  # warm-up: lazy imports, connections, caches
        for kind, fn in kinds.items():
            for _ in range(3 if "stream" in kind else 30):
                fn()
        flush()
    except Exception as e:  # noqa: BLE001
        proto.write("SKIP " + json.dumps(f"a call failed: {type(e).__name__}: {e}") + "\n")
        return 3
    proto.write("READY\n")
    for line in sys.stdin:
        if line.strip() == "END":
            break
        kind, n = line.split()
        fn, n = kinds[kind], int(n)
        before = exported["spans"]
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            fn()
        flush()  # the export (OTLP encoding) of this block's spans counts in this block
        c1, w1 = time.process_time(), time.perf_counter()
        proto.write(f"DONE {(c1 - c0) / n} {(w1 - w0) / n} {exported['spans'] - before}\n")

    metric_points = {}
    if reader:
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    metric_points[m.name] = metric_points.get(m.name, 0) + len(m.data.data_points)
    versions = {}
    for dist in ["openai", "httpx2", "opentelemetry-sdk", *spec.dists]:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "?"
    loop.run_until_complete(aclient.close())
    loop.close()
    client.close()
    if tracer_provider:
        tracer_provider.shutdown()
        meter_provider.shutdown()
    proto.write(
        "RESULT "
        + json.dumps(
            {
                "span_names": exported["names"],
                "span_attributes": exported["sample"],
                "otlp_bytes_per_span": exported["bytes"] / exported["spans"] if exported["spans"] else 0,
                "metric_points": metric_points,
                "versions": versions,
            }
        )
        + "\n"
    )
    return 0


def sdk_floor(kinds: dict, tracer_provider, meter_provider) -> dict:
    """Each call wrapped in what any GenAI instrumentation must at least do, written directly on
    the SDK: one CLIENT span with 15 attributes (those the official instrumentation sets, fixed
    values), a duration and two token histogram records, nothing per chunk. A reference, not ranked."""
    from opentelemetry import trace

    tracer = tracer_provider.get_tracer("sdk-floor")
    meter = meter_provider.get_meter("sdk-floor")
    duration = meter.create_histogram("gen_ai.client.operation.duration", unit="s")
    tokens = meter.create_histogram("gen_ai.client.token.usage", unit="{token}")
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": MODEL,
        "server.address": "127.0.0.1",
        "server.port": 8000,
    }
    start = {**common, "gen_ai.request.max_tokens": 16, "gen_ai.request.temperature": 0.7}
    end = {
        "gen_ai.response.id": "chatcmpl-bench",
        "gen_ai.response.model": MODEL,
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 22,
        "gen_ai.usage.output_tokens": 16,
        "gen_ai.usage.cache_read.input_tokens": 8,
        "openai.response.service_tier": "default",
        "openai.response.system_fingerprint": "fp_bench",
    }
    metric_attrs = {**common, "gen_ai.response.model": MODEL}
    input_attrs = {**metric_attrs, "gen_ai.token.type": "input"}
    output_attrs = {**metric_attrs, "gen_ai.token.type": "output"}

    def wrap(fn):
        def call():
            started = time.perf_counter()
            with tracer.start_as_current_span(f"chat {MODEL}", kind=trace.SpanKind.CLIENT, attributes=start) as span:
                fn()
                span.set_attributes(end)
            duration.record(time.perf_counter() - started, metric_attrs)
            tokens.record(22, input_attrs)
            tokens.record(16, output_attrs)

        return call

    return {kind: wrap(fn) for kind, fn in kinds.items()}


class Worker:
    """The parent's handle on one variant's process."""

    def __init__(self, name: str, url: str):
        spec = VARIANTS[name]
        cmd = [sys.executable, __file__, "--worker", name, "--url", url]
        if spec.requirements:
            cmd += ["--peer-dir", str(PEERS_DIR / name)]
        env = {**os.environ, **spec.env}
        env.pop("PYTHONPATH", None)
        self.name = name
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1, env=env
        )

    def _read(self, timeout: float = 300) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line.startswith("SKIP "):
            raise RuntimeError(json.loads(line[5:]))
        if not line:
            self.proc.kill()
            raise RuntimeError(f"worker failed: {self.stderr_tail() or 'no answer in time'}")
        return line

    def stderr_lines(self) -> list[str]:
        self.stderr.seek(0)
        return [line.rstrip() for line in self.stderr if line.strip()]

    def stderr_tail(self) -> str:
        lines = self.stderr_lines()
        return lines[-1] if lines else ""

    def ready(self) -> None:
        self._read()

    def block(self, kind: str, n: int) -> tuple[float, float, int]:
        self.proc.stdin.write(f"{kind} {n}\n")
        cpu, wall, spans = self._read().split()[1:]
        return float(cpu), float(wall), int(spans)

    def end(self) -> dict:
        self.proc.stdin.write("END\n")
        result = json.loads(self._read()[7:])
        self.proc.wait(timeout=60)
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- parent ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=150, help="at most this many rounds ...")
    parser.add_argument("--seconds", type=float, default=180, help="... or rounds for about this long (min 3 rounds)")
    parser.add_argument("--calls", type=int, default=16, help="non-stream chat calls per block (legacy: half)")
    parser.add_argument("--stream-calls", type=int, default=2, help="streamed calls per block, for each K")
    parser.add_argument("--no-install", action="store_true", help="do not pip-install missing peers")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--peer-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve()
    if args.worker:
        return worker(args)

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "bare" not in names:
        parser.error(f"unknown variants {unknown}" if unknown else "'bare' is needed as the baseline")
    skipped: dict[str, str] = {}
    for name in names:
        reason = ensure_peer(name, not args.no_install)
        if reason:
            skipped[name] = reason

    started, load0 = time.perf_counter(), os.getloadavg()[0]
    blocks = _sizes(args)
    server, url = start_server()
    workers = {n: Worker(n, url) for n in names if n not in skipped}
    # per variant and kind, one (cpu s/call, wall s/call, spans/call) per round
    samples = {n: {k: [] for k in blocks} for n in workers}
    results, stderr = {}, {}
    try:
        for name, w in list(workers.items()):
            try:
                w.ready()
            except RuntimeError as e:
                skipped[name] = str(e)
                stderr[name] = w.stderr_lines()
                del workers[name]
        if "bare" not in workers:
            print("bare did not start:", skipped.get("bare"))
            return 1
        print(
            f"{len(workers)} variants, one process each: {', '.join(workers)}; up to {args.rounds} rounds "
            f"or ~{args.seconds:.0f} s ...",
            flush=True,
        )
        measuring, last_note = time.perf_counter(), time.perf_counter()
        for r in range(args.rounds):
            if r >= 3 and time.perf_counter() - measuring > args.seconds:
                break
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]  # ABBA ...
            for kind, n in blocks.items():  # kind-major: one kind's blocks of all variants lie close in time
                for name in order:
                    if name not in workers:
                        continue
                    try:
                        cpu, wall, spans = workers[name].block(kind, n)
                    except RuntimeError as e:
                        skipped[name] = str(e)
                        stderr[name] = workers.pop(name).stderr_lines()
                        continue
                    samples[name][kind].append((cpu, wall, spans / n))
            if time.perf_counter() - last_note > 30:
                last_note = time.perf_counter()
                print(f"  {r + 1} rounds, {last_note - measuring:.0f} s", flush=True)
        for name, w in workers.items():
            try:
                results[name] = w.end()
            except RuntimeError as e:
                skipped[name] = str(e)
            stderr[name] = w.stderr_lines()
    finally:
        for w in workers.values():
            w.kill()
        server.terminate()
        server.wait()
    done = [n for n in names if n in results and n not in skipped]
    report(done, samples, results, skipped, stderr, args, time.perf_counter() - started, load0)
    return 0


def _notch(values: list[float]) -> float:
    """Half-width of a boxplot notch, 1.58 IQR / sqrt(n): a rough 95% interval for the median."""
    if len(values) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(values, n=4)
    return 1.58 * (q3 - q1) / len(values) ** 0.5


def report(done, samples, results, skipped, stderr, args, elapsed, load0) -> None:
    med = statistics.median

    def series(name, kind, i=0):  # i: 0 cpu, 1 wall, 2 spans per call
        return [s[i] for s in samples[name][kind]]

    def per_chunk(prefix):  # per round: (t[K=LONG] - t[K=SHORT]) / (LONG - SHORT)
        def get(name, i=0):
            return [
                (a - b) / (LONG - SHORT)
                for a, b in zip(series(name, f"{prefix}{LONG}", i), series(name, f"{prefix}{SHORT}", i))
            ]

        return get

    def per_call(kind):
        return lambda name, i=0: series(name, kind, i)

    def versus(name, get, i=0):
        """(bare's median, median same-round ratio to bare, its notch): the machine's speed drifts by
        up to 2x on a shared VM, but is nearly the same within a round, so ratios cancel it out."""
        ratios = [x / y for x, y in zip(get(name, i), get("bare", i))]
        return med(get("bare", i)), med(ratios), _notch(ratios)

    rounds = len(samples["bare"]["chat"])
    versions = results["bare"]["versions"]
    print(
        f"\nClient overhead of OpenAI instrumentations: openai {versions['openai']} (httpx2 {versions['httpx2']}), "
        f"opentelemetry-sdk {versions['opentelemetry-sdk']}. {rounds} rounds, in each one block per variant and kind "
        f"({args.calls} chat calls, {args.stream_calls} streams per K), variants alternated."
    )
    print(
        "us: client-process CPU microseconds (all threads, OTLP encoding of the spans included), wall in brackets; "
        "x bare: median of same-round ratios to bare, ± a rough 95% interval; us = bare's median x that ratio; "
        f"added = us - bare; per chunk = (t[K={LONG}] - t[K={SHORT}]) / {LONG - SHORT}, streams fully consumed; "
        "spans: made during the timed blocks."
    )
    print(
        f"{'variant':12} {'spans':>6} | {'us/call':>8} {'x bare':>12} {'added':>7} {'(wall)':>7} |"
        f" {'us/chunk':>8} {'x bare':>12} {'added':>7} {'(wall)':>7}"
    )
    sizes = _sizes(args)
    est = {}
    for name in done:
        spans = round(sum(s[2] * sizes[kind] for kind in sizes for s in samples[name][kind]))
        row = f"{name:12} {spans:6d} |"
        for get, fmt in ((per_call("chat"), ".1f"), (per_chunk("stream"), ".2f")):
            base, ratio, notch = versus(name, get)
            wbase, wratio, _ = versus(name, get, 1)
            est.setdefault(name, []).append((ratio, notch, (ratio - 1) * base))
            row += (
                f" {base * ratio * 1e6:8{fmt}} {ratio:5.2f} ±{notch:5.2f} {(ratio - 1) * base * 1e6:+7{fmt}}"
                f" {wbase * wratio * 1e6:7{fmt}} |"
            )
        print(row.rstrip(" |"))

    print(
        f"\nMore, CPU us (added): a stream's fixed cost (K={SHORT}), the async client per chunk, a legacy "
        "completion; spans per call by kind"
    )
    print(
        f"{'variant':12} {'stream K=1 /call':>17} {'async /chunk':>16} {'legacy /call':>16}"
        f" {'spans chat/stream/async/legacy':>31} {'OTLP B/span':>11}"
    )
    for name in done:
        row = f"{name:12}"
        for get, width, fmt in (
            (per_call("stream1"), 8, ".1f"),
            (per_chunk("astream"), 7, ".2f"),
            (per_call("legacy"), 7, ".1f"),
        ):
            base, ratio, _ = versus(name, get)
            row += f" {base * ratio * 1e6:{width}{fmt}} ({(ratio - 1) * base * 1e6:+6{fmt}})"
        spc = [med(series(name, k, 2)) for k in ("chat", f"stream{LONG}", f"astream{LONG}", "legacy")]
        print(f"{row} {' / '.join(f'{x:.2f}' for x in spc):>31} {results[name]['otlp_bytes_per_span']:11.0f}")

    if any(VARIANTS[n].instrumented for n in done):
        print("\nWhat each instrumented variant made (span counts include warm-up):")
    broken = []
    for name in done:
        if not VARIANTS[name].instrumented:
            continue
        res = results[name]
        own = ", ".join(
            f"{d} {v}" for d, v in res["versions"].items() if d not in ("openai", "httpx2", "opentelemetry-sdk")
        )
        print(f"  {name} ({own or 'the SDK alone'}): spans by name {res['span_names'] or 'NONE'}")
        for span_name, attrs in res["span_attributes"].items():
            print(f"      {span_name!r}: {len(attrs)} attributes: {', '.join(attrs)}")
        print(f"      metrics (data points): {res['metric_points'] or 'none'}")
        if med(series(name, "chat", 2)) == 0:
            broken.append(name)
        missing = [k for k in ("chat", f"stream{LONG}", f"astream{LONG}", "legacy") if med(series(name, k, 2)) == 0]
        if missing:
            print(f"      no span for: {', '.join(missing)} calls")
    for name in done + list(skipped):
        if stderr.get(name):
            lines = stderr[name]
            print(f"  {name} stderr ({len(lines)} lines): " + " | ".join(lines[:3])[:400])
    for name in broken:
        print(f"  BROKEN MEASUREMENT: {name} made no span for chat calls; its figures are not an instrumentation's")
    for name, reason in skipped.items():
        hint = " (otel_llm.openai missing or broken in this checkout)" if name == "otel-llm" else ""
        print(f"  SKIPPED {name}: {reason}{hint}")

    print()
    if "bare-aa" in done:
        aa = [versus("bare-aa", get)[1] for get in (per_call("chat"), per_chunk("stream"))]
        print(
            f"A/A: bare-aa, the same code as bare in another process, reads x{aa[0]:.2f} per call and x{aa[1]:.2f} "
            "per chunk: differences of that size are the method's noise."
        )
    print(
        f"Load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} CPUs: other work on "
        f"the machine (and the fake server on the other core) adds noise, mostly to wall time; {elapsed:.0f} s."
    )
    rated = [n for n in done if VARIANTS[n].module and n not in broken]  # sdk-floor is a reference
    if rated:
        words = []
        for i, what in enumerate(("per call", "per chunk")):
            best, *rest = sorted(rated, key=lambda n: est[n][i][0])
            ratio, notch, added = est[best][i]
            tied = [n for n in rest if est[n][i][0] - est[n][i][1] <= ratio + notch]
            words.append(
                f"{what} {best} ({added * 1e6:+.{1 + i}f} us, x{ratio:.2f})"
                + (f", within noise of {', '.join(tied)}" if tied else "")
            )
        print("Cheapest instrumented variant: " + "; ".join(words) + ".")
    if "otel-llm" in done:
        print(
            f"otel-llm's stream proxy alone, in process (no HTTP, no parsing): {_proxy_ns_per_chunk():.0f} ns per "
            "chunk: per-chunk costs that small are below this benchmark's resolution."
        )


def _proxy_ns_per_chunk(n: int = 200_000) -> float:
    """Added time per chunk of otel_llm.openai's StreamProxy over the same parsed chunk, in ns."""
    sys.path.insert(0, str(ROOT))
    from openai.types.chat import ChatCompletionChunk
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from otel_llm.config import ClientSettings
    from otel_llm.openai.streams import StreamProxy
    from otel_llm.openai.telemetry import ClientTelemetry, Invocation

    telemetry = ClientTelemetry(
        TracerProvider().get_tracer("bench"), MeterProvider().get_meter("bench"), ClientSettings()
    )
    chunk = ChatCompletionChunk.model_validate(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
            "usage": None,
        }
    )

    def per_chunk(wrap: bool) -> float:
        stream = iter([chunk] * n)
        if wrap:
            stream = StreamProxy(stream, Invocation(telemetry, "chat", None, None, {"model": MODEL, "stream": True}))
        start = time.perf_counter()
        for _ in stream:
            pass
        return (time.perf_counter() - start) / n * 1e9

    return statistics.median(per_chunk(True) - per_chunk(False) for _ in range(3))


def _sizes(args) -> dict[str, int]:
    return {
        "chat": args.calls,
        "stream1": args.stream_calls,
        f"stream{LONG}": args.stream_calls,
        "astream1": args.stream_calls,
        f"astream{LONG}": args.stream_calls,
        "legacy": max(1, args.calls // 2),
    }


if __name__ == "__main__":
    sys.exit(main())

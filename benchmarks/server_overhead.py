"""Server-side overhead of otel-llm, measured side by side in one run.

Part 1, end to end: the same load on the same tiny model against `vllm serve` bare, under
otel-llm (opentelemetry-instrument), with vLLM's native tracing (--otlp-traces-endpoint), and
with plain FastAPI auto-instrumentation (ours disabled); plus a second bare server for an A/A
run that shows the method's spread. Runs alternate (ABBA ...); reported are medians of the
API-server process CPU per request (from /proc) and of throughput. On a shared 2-core VM
this catches gross costs only.

Part 2, in process and precise: real vLLM RequestStates and EngineCoreOutputs, recorded from
an offline run of the real engine, replayed through a real OutputProcessor with and without
our hooks, with the full span tree and metrics exported over OTLP/HTTP to a receiver in
another process. CPU microseconds per request, and per streamed chunk for the SSE wrapper.
With "otel-llm + usage spool" (OTEL_LLM_USAGE_DIR on the real disk, default fsync interval) it
also gives what the billing ledger's record adds per request, beside a micro-measurement of
`UsageLedger.write` alone and of the spool's fsync thread at 200 requests/s.

    python benchmarks/server_overhead.py [--part e2e|inprocess|ledger|all] [--requests 64]

`--part 2` (= inprocess) runs part 2 alone (about a minute: it records the engine first);
`--part ledger` only the ledger micro-measurements (seconds, no vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
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
SPOOL_VARIANT = "otel-llm + usage spool"


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def start_receiver_process() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "devkit.otlp_receiver", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    return proc, f"http://127.0.0.1:{port}"


# --- part 1 -------------------------------------------------------------------------------

async def run_load(url: str, requests: int, concurrency: int, stream: bool, max_tokens: int) -> float:
    import httpx

    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "tell me about tracing"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
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


def part_e2e(requests: int, rounds: int, concurrency: int, max_tokens: int) -> dict:
    receiver, endpoint = start_receiver_process()
    configs = {
        "bare": dict(instrumented=False),
        "otel-llm": dict(instrumented=True, env=otlp_env(endpoint)),
        "vllm-native": dict(instrumented=False, extra_args=["--otlp-traces-endpoint", endpoint + "/v1/traces"],
                            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}),
        "fastapi-only": dict(instrumented=True, env={**otlp_env(endpoint),
                                                     "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "otel_llm_vllm"}),
        "bare (A/A)": dict(instrumented=False),
    }
    # One server at a time: idle vLLM CPU engines still poll, so servers side by side on a
    # 2-core machine disturb each other's measurements.
    results: dict = {}
    try:
        for r in range(rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                print(f"round {r + 1}: {name} ...", flush=True)
                with VLLMServer(**configs[name]) as server:
                    pid = server.process.pid
                    for stream in ((False, True) if r % 2 == 0 else (True, False)):
                        asyncio.run(run_load(server.url, 16, concurrency, stream, max_tokens))  # warm
                        cpu0 = process_cpu_seconds(pid)
                        wall = asyncio.run(run_load(server.url, requests, concurrency, stream, max_tokens))
                        cpu = process_cpu_seconds(pid) - cpu0
                        results.setdefault((name, stream), []).append((cpu / requests, requests / wall))
    finally:
        receiver.terminate()
    servers = list(configs)
    print(f"\nPart 1: end to end, {requests} requests x {rounds} runs each, concurrency {concurrency}, "
          f"{max_tokens} output tokens; medians")
    print(f"{'config':14} {'mode':10} {'API CPU ms/req':>15} {'vs bare':>8} {'req/s':>8} {'vs bare':>8}")
    summary = {}
    for stream in (False, True):
        base_cpu = statistics.median(c for c, _ in results[("bare", stream)])
        base_tput = statistics.median(t for _, t in results[("bare", stream)])
        for name in servers:
            cpu = statistics.median(c for c, _ in results[(name, stream)])
            tput = statistics.median(t for _, t in results[(name, stream)])
            mode = "stream" if stream else "non-stream"
            summary[(name, mode)] = cpu
            print(f"{name:14} {mode:10} {cpu * 1e3:15.2f} {cpu / base_cpu:8.2f} {tput:8.1f} {tput / base_tput:8.2f}")
    return summary


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
    llm = LLM(model=str(build(DEFAULT_MODEL_DIR)), served_model_name=MODEL_NAME, dtype="float32", enforce_eager=True,
              max_model_len=512, gpu_memory_utilization=0.3, disable_log_stats=False)
    try:
        prompts = [f"request {i}: tell me about tracing" for i in range(n_requests)]
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        tokenizer = llm.llm_engine.output_processor.tokenizer
    finally:
        OutputProcessor.add_request, OutputProcessor.process_outputs = original_add, original_process
        llm.llm_engine.engine_core.shutdown()
    n_outputs = sum(len(outputs) for outputs, _ in batches)
    return added, batches, tokenizer, n_outputs


def part_inprocess(n_requests: int, max_tokens: int, rounds: int, bare_cpu_per_request: float,
                   bare_cpu_source: str) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    from otel_llm.vllm import VLLMInstrumentor, wrappers
    from otel_llm.vllm.request_telemetry import attach, detach, start_request

    added, batches, tokenizer, n_outputs = record_engine_traffic(n_requests, max_tokens)
    receiver, endpoint = start_receiver_process()
    tracer_provider = TracerProvider()
    # a queue that never drops: a dropped span would be a span we did not pay to export
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint + "/v1/traces"),
                                                          max_queue_size=1_000_000))
    meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint + "/v1/metrics"), export_interval_millis=1000)])
    chat_request = ChatCompletionRequest(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=max_tokens, temperature=0.7)
    raw_request = SimpleNamespace(headers={"x-tenant-id": "bench"}, state=SimpleNamespace())
    instrumentor = VLLMInstrumentor()

    def replay(instrumented: bool, iterations: int) -> float:
        op = OutputProcessor(tokenizer, log_stats=True)
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
        if instrumented:
            tracer_provider.force_flush()
            meter_provider.force_flush()
        return time.process_time() - started

    iterations = 40
    variants = ("bare", "otel-llm", "no-phase-spans", SPOOL_VARIANT)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    saved_usage_dir = os.environ.pop("OTEL_LLM_USAGE_DIR", None)
    # the spool on the real disk (the repository's filesystem), as a server's OTEL_LLM_USAGE_DIR would be
    spool_root = Path(tempfile.mkdtemp(prefix="bench-usage-spool-", dir=ROOT / ".cache"))
    try:
        for r in range(-1, rounds):  # round -1 warms every variant up (first instrumentation, caches); not kept
            for variant in (variants if r % 2 == 0 else tuple(reversed(variants))):
                instrumented = variant != "bare"
                if instrumented:
                    os.environ["OTEL_LLM_PHASE_SPANS"] = "false" if variant == "no-phase-spans" else "true"
                    if variant == SPOOL_VARIANT:
                        os.environ["OTEL_LLM_USAGE_DIR"] = str(spool_root / f"round-{r}")
                    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
                try:
                    cost = replay(instrumented, iterations) / (iterations * len(added))
                    if r >= 0:
                        samples[variant].append(cost)
                finally:
                    if instrumented:
                        if variant == SPOOL_VARIANT:
                            VLLMInstrumentor._patcher.telemetry.ledger.close()  # stops its fsync thread
                            os.environ.pop("OTEL_LLM_USAGE_DIR", None)
                        instrumentor.uninstrument()
        os.environ.pop("OTEL_LLM_PHASE_SPANS", None)
        chunk_cost = stream_wrapper_cost()
        sdk_floor = sdk_span_floor(tracer_provider)
        spool_lines = sum(f.read_bytes().count(b"\n") for f in spool_root.rglob("usage-*.jsonl"))
        micro = ledger_micro(spool_root / "micro")
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
        receiver.terminate()
        shutil.rmtree(spool_root, ignore_errors=True)
        if saved_usage_dir is not None:
            os.environ["OTEL_LLM_USAGE_DIR"] = saved_usage_dir
    bare = statistics.median(samples["bare"])
    ours = statistics.median(samples["otel-llm"])
    no_phases = statistics.median(samples["no-phase-spans"])
    with_spool = statistics.median(samples[SPOOL_VARIANT])
    # the ledger's share: spool minus otel-llm within each round (same moment of the VM's speed)
    ledger_deltas = sorted(s - o for s, o in zip(samples[SPOOL_VARIANT], samples["otel-llm"]))
    ledger_us = statistics.median(ledger_deltas) * 1e6
    added_us = (ours - bare) * 1e6
    print(f"\nPart 2: in process, real vLLM objects ({len(added)} requests, {n_outputs} engine outputs recorded, "
          f"{max_tokens} tokens each), {rounds} alternated runs (after a warm-up run) x {iterations} replays; medians")
    print(f"  OutputProcessor CPU per request, bare:          {bare * 1e6:8.1f} us")
    print(f"  ... with otel-llm (4 spans + metrics, OTLP):    {ours * 1e6:8.1f} us")
    print(f"  otel-llm's own cost per request:                {added_us:8.1f} us")
    print(f"  ... of which the SDK's 4 spans + OTLP export:   {sdk_floor * 1e6:8.1f} us (same spans, same attributes,")
    print("      created and exported by the SDK alone: the floor for this span tree)")
    print(f"  with OTEL_LLM_PHASE_SPANS=false (1 span):       {(no_phases - bare) * 1e6:8.1f} us")
    print("  per engine output (hooks on the output path):   0 (none: process_outputs is not wrapped)")
    print(f"  SSE stream wrapper, per chunk after the first:  {chunk_cost * 1e6:8.2f} us")
    per_request_total = added_us + chunk_cost * 1e6 * max_tokens
    print(f"  total per streamed request ({max_tokens} chunks):        {per_request_total:8.1f} us")
    bare_us = bare_cpu_per_request * 1e6
    print(f"  as a share of bare API-server CPU per request ({bare_cpu_per_request * 1e3:.2f} ms, {bare_cpu_source}): "
          f"{per_request_total / bare_us * 100:.2f}%  (target <= 5%)")
    expected_lines = (rounds + 1) * iterations * len(added)
    print(f"\n  Usage ledger (billing record per request; {SPOOL_VARIANT}: OTEL_LLM_USAGE_DIR on the real disk, "
          f"fsync every 1 s by its thread)")
    print(f"  ... with otel-llm + usage spool:                {with_spool * 1e6:8.1f} us  "
          f"({spool_lines:,} records written, {expected_lines:,} expected)")
    print(f"  the ledger's own cost per request:              {ledger_us:8.1f} us  (spool minus otel-llm, median of "
          f"{rounds} same-round pairs; sorted: {', '.join(f'{d * 1e6:.0f}' for d in ledger_deltas)})")
    print(f"  as a share of bare API-server CPU per request ({bare_cpu_per_request * 1e3:.2f} ms, {bare_cpu_source}): "
          f"{ledger_us / bare_us * 100:.2f}%  (target <= 1%)")
    print_ledger_micro(micro, bare_us, bare_cpu_source)


def sample_usage_fields() -> dict:
    """A usage record's fields as RequestTelemetry._write_usage builds them for a chat request."""
    request_id = "chatcmpl-7f3c2a9e4b1d4c8e9a6f0b2d5e8c1a47"
    return {
        semconv.USAGE_ID: f"vllm-0/{request_id}-3f9a1c2e", semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
        semconv.SERVICE_NAME: "vllm", semconv.SERVICE_INSTANCE_ID: "vllm-0", semconv.VLLM_REQUEST_ID: request_id,
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT, semconv.REQUEST_OUTCOME: semconv.OUTCOME_FINISHED,
        semconv.USAGE_DURATION: 1.2345678, semconv.GEN_AI_USAGE_INPUT_TOKENS: 812,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 256, semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 143,
        semconv.GEN_AI_REQUEST_CHOICE_COUNT: 1, semconv.GEN_AI_REQUEST_MODEL: "llama-3.1-8b-instruct",
        semconv.GEN_AI_RESPONSE_MODEL: "llama-3.1-8b-instruct", semconv.GEN_AI_RESPONSE_ID: request_id,
        semconv.TENANT_ID: "tenant-0042", semconv.TENANT_SCENE: "search", semconv.TENANT_COST_CENTER: "cc-112",
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
    }


def ledger_micro(directory: Path, records: int = 20000, rate: float = 200.0, seconds: float = 3.0) -> dict:
    """`UsageLedger.write` alone (CPU per record, spool on the real disk), and the CPU its spool's fsync
    thread spends per record when records come at `rate` a second (the default 1 s fsync interval)."""
    import json

    from opentelemetry.metrics import NoOpMeter

    from otel_llm.usage import UsageLedger

    fields = sample_usage_fields()
    context = SimpleNamespace(is_valid=True, trace_id=0x5B8EFFF798038103D269B633813FC60C, span_id=0xEEE19B7EC3C1B174)
    ledger = UsageLedger(NoOpMeter("bench"), directory=str(directory), events=False, instance="vllm-0",
                         service="vllm")
    try:
        ledger.write(fields, time.time_ns(), context)  # opens the file, starts the fsync thread
        batch = records // 5
        per_batch = []
        for _ in range(5):  # back to back: dict copy + json.dumps + one os.write each
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
            json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode()
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
    return {"write_s": write_s, "encode_s": encode_s, "line_bytes": line_bytes, "rate": rate, "seconds": seconds,
            "fsync_thread_per_record_s": fsync_thread_s / n, "fsync_thread_s": fsync_thread_s,
            "sync_cpu_s": statistics.median(c for c, _ in syncs), "sync_wall_s": statistics.median(w for _, w in syncs)}


def print_ledger_micro(m: dict, bare_us: float, bare_cpu_source: str) -> None:
    fsync_us = m["fsync_thread_per_record_s"] * 1e6
    print(f"  UsageLedger.write alone ({m['line_bytes']:.0f}-byte line, spool on the real disk): "
          f"{m['write_s'] * 1e6:6.1f} us/record CPU (of which building the JSON line {m['encode_s'] * 1e6:.1f} us, "
          f"the rest mostly the os.write)")
    print(f"  its fsync thread at {m['rate']:.0f} records/s ({m['seconds']:.0f} s paced, fsync every 1 s): "
          f"{m['fsync_thread_s'] * 1e3:.2f} ms CPU in all = {fsync_us:.2f} us/record "
          f"(one fsync: {m['sync_cpu_s'] * 1e6:.0f} us CPU, {m['sync_wall_s'] * 1e3:.2f} ms wall, off the request path)")
    total = m["write_s"] * 1e6 + fsync_us
    print(f"  write + fsync share per record at {m['rate']:.0f}/s: {total:.1f} us = {total / bare_us * 100:.2f}% of "
          f"the bare API-server CPU per request ({bare_us / 1e3:.2f} ms, {bare_cpu_source}; target <= 1%)")


def sdk_span_floor(tracer_provider, n: int = 3000) -> float:
    """CPU per request of the same 4-span tree made with the bare SDK and exported over OTLP."""
    from opentelemetry import trace

    tracer = tracer_provider.get_tracer("floor")
    start_attrs = {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_PROVIDER_NAME: "vllm",
                   semconv.GEN_AI_REQUEST_MODEL: MODEL_NAME, semconv.GEN_AI_REQUEST_MAX_TOKENS: 16,
                   semconv.GEN_AI_REQUEST_TEMPERATURE: 0.7, semconv.TENANT_ID: "bench"}
    end_attrs = {name: 1 for name in (
        semconv.GEN_AI_USAGE_INPUT_TOKENS, semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, semconv.VLLM_PREEMPTIONS)}
    end_attrs.update({name: 0.5 for name in (
        semconv.VLLM_QUEUE_SECONDS, semconv.VLLM_PREFILL_SECONDS, semconv.VLLM_DECODE_SECONDS,
        semconv.VLLM_TTFT_SECONDS, semconv.VLLM_TPOT_SECONDS)})
    end_attrs.update({semconv.GEN_AI_RESPONSE_ID: "chatcmpl-x", semconv.GEN_AI_RESPONSE_MODEL: MODEL_NAME,
                      semconv.VLLM_REQUEST_ID: "chatcmpl-x", semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["length"]})
    started = time.process_time()
    for _ in range(n):
        span = tracer.start_span("chat tiny-llama", attributes=start_attrs)
        ctx = trace.set_span_in_context(span)
        for name in semconv.PHASE_SPANS:
            tracer.start_span(name, context=ctx, start_time=time.time_ns()).end()
        span.set_attributes(end_attrs)
        span.end()
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
    parser.add_argument("--part", choices=("e2e", "1", "inprocess", "2", "ledger", "all"), default="all",
                        help="1 = e2e, 2 = inprocess (with the usage-spool variant); ledger: only the ledger "
                             "micro-measurements (seconds, no vLLM)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--inprocess-rounds", type=int, default=8,
                        help="alternated rounds of part 2's variants (after one warm-up round)")
    parser.add_argument("--bare-cpu-ms", type=float, default=None,
                        help="bare API-server CPU per request (ms) for part 2's share, when part 1 is skipped")
    args = parser.parse_args()
    part = {"1": "e2e", "2": "inprocess"}.get(args.part, args.part)
    if args.bare_cpu_ms:
        bare_cpu, bare_source = args.bare_cpu_ms / 1e3, "--bare-cpu-ms"
    else:
        bare_cpu, bare_source = LAST_BARE_CPU_MS / 1e3, "part 1's last run, not measured now"
    if part == "ledger":
        micro = ledger_micro(Path(tempfile.mkdtemp(prefix="bench-usage-spool-", dir=ROOT / ".cache")))
        print("Usage ledger, in process:")
        print_ledger_micro(micro, bare_cpu * 1e6, bare_source)
        return 0
    build(DEFAULT_MODEL_DIR)
    if part in ("e2e", "all"):
        summary = part_e2e(args.requests, args.rounds, args.concurrency, args.max_tokens)
        bare_cpu = min(summary[("bare", "stream")], summary[("bare", "non-stream")])
        bare_source = "part 1 of this run"
    if part in ("inprocess", "all"):
        part_inprocess(16, args.max_tokens, max(args.rounds, args.inprocess_rounds), bare_cpu, bare_source)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The least the API server could do per request for the default setup's telemetry (issue 24's floor).

`server_overhead.py --part api --floor` runs this beside the default setup and vLLM's native tracing.
It is no product: no guards, no configuration, no sampling but "always on", one route. It does, per
request, only what the API server must do whatever the design, and hands everything else to another
process as one flat tuple of facts:

- HTTP: one pass over the request headers (traceparent, Host, the tenant header), the trace and span
  ids as the SDK's RandomIdGenerator makes them (or the client's trace id), the start time, the
  active-requests count (a dict), the response start taken from the one `send` wrapper, then the
  ASGI scope's keys copied (credential headers left out), the route template and the duration;
- GenAI: the handler's request fields read from its `__dict__`, the span id, the engine request's
  traceparent for the engine core, its RequestState kept (and registered by engine request id, as
  the finish and abort hooks need) and read once at the end with otel_llm's own reader
  (`contract.read_engine_request`), the usage record built as RequestTelemetry._write_usage builds it
  and written to a spool file with otel_llm's own encoder (`usage.json_line`), the stream passed
  through one generator;
- one message per request: `marshal.dumps` of the facts and one `os.write` to a pipe whose reader
  (another process) discards it. The reader reads as the export process does: every
  `process.POLL_S`, never waiting on the pipe, so no write wakes it; `server_overhead.py` pins it off
  the API server's CPU as it pins the export process (`reader_pid`).

`--floor` runs it twice: with the message written, and without (the facts marshalled, not written).
Until 2026-12-07 the reader was `cat`, blocked on the pipe and left on every CPU: each write woke it,
the scheduler ran it on the writer's own CPU, and the message seemed to cost the API server about
90 us (docs/api-server-cost.md, "The floor").

What the export process would build from the facts (span attributes, phase spans, metrics, the
replayed HTTP middleware) is not done here. So this is a lower bound on any design that keeps the
usage record crash-safe in the API server: if the floor is not well below native tracing, no
rewrite of the request path meets the target.
"""

from __future__ import annotations

import fcntl
import marshal
import os
import random
import subprocess
import sys
import time
from contextvars import ContextVar

from otel_llm import semconv
from otel_llm.usage import json_line
from otel_llm.vllm import contract
from otel_llm.vllm.export.http import _CREDENTIAL_HEADERS  # what the API server keeps today
from otel_llm.vllm.export.process import POLL_S
from otel_llm.vllm.export.wire import SCOPE_KEYS

_CURRENT: ContextVar[Facts | None] = ContextVar("floor_request", default=None)
_TENANT_HEADER = b"x-tenant-id"
# the discarding reader: its end of the pipe read every POLL_S (argv[1]) until the writer closes it
_READER = """
import os, sys, time
os.set_blocking(0, False)
while True:
    try:
        if not os.read(0, 1 << 20):
            break
    except BlockingIOError:
        time.sleep(float(sys.argv[1]))
"""


class Facts:
    __slots__ = (
        "trace_id",
        "span_id",
        "parent_id",
        "start_ns",
        "headers",
        "status",
        "response_headers",
        "genai",
        "genai_span_id",
        "genai_start_ns",
        "states",
    )

    def __init__(self):
        self.status = None
        self.response_headers = None
        self.genai = None
        self.genai_span_id = None
        self.states = []


class Floor:
    """The process-wide part: the pipe to the discarding reader, the spool file, the registries."""

    def __init__(self, spool_path: str, write_messages: bool = True):
        self.write_messages = write_messages
        self.reader = subprocess.Popen([sys.executable, "-c", _READER, str(POLL_S)], stdin=subprocess.PIPE)
        self.pipe = self.reader.stdin.fileno()
        try:  # (a poll interval's messages, many times over; the default 64 KB holds a few, and a full pipe
            # only makes the write wait, which costs no CPU)
            fcntl.fcntl(self.pipe, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:  # above fs.pipe-max-size, or the user's pipe pages spent
            pass
        self.spool = os.open(spool_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.active: dict[tuple, int] = {}
        self.engine_requests: dict[str, Facts] = {}
        self.sent = 0

    @property
    def reader_pid(self) -> int:
        return self.reader.pid

    def close(self) -> None:
        os.close(self.spool)
        self.reader.stdin.close()
        self.reader.wait()

    def send(self, facts: tuple) -> None:
        data = marshal.dumps(facts)
        if self.write_messages:
            os.write(self.pipe, len(data).to_bytes(4, "little") + data)
        self.sent += 1

    def middleware(self, app):
        floor = self

        async def asgi(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            facts = Facts()
            index = {}
            for name, value in scope["headers"]:
                index[name.lower()] = value
            facts.headers = index
            traceparent = index.get(b"traceparent")
            if traceparent is not None and len(traceparent) == 55:
                facts.trace_id, facts.parent_id = int(traceparent[3:35], 16), int(traceparent[36:52], 16)
            else:
                facts.trace_id, facts.parent_id = random.getrandbits(128), 0
            facts.span_id = random.getrandbits(64)
            facts.start_ns = time.time_ns()
            started = time.perf_counter()
            key = (scope["method"], scope["scheme"], scope["http_version"], index.get(b"host"))
            floor.active[key] = floor.active.get(key, 0) + 1
            token = _CURRENT.set(facts)

            async def keep_start(message):
                if message["type"] == "http.response.start":
                    facts.status = message["status"]
                    facts.response_headers = message.get("headers")
                await send(message)

            try:
                await app(scope, receive, keep_start)
            finally:
                duration = time.perf_counter() - started
                _CURRENT.reset(token)
                floor.active[key] -= 1
                snapshot = {key: scope[key] for key in SCOPE_KEYS if key in scope}
                snapshot["headers"] = [h for h in scope["headers"] if h[0] not in _CREDENTIAL_HEADERS]
                route = getattr(scope.get("route"), "path_format", None)
                headers = [tuple(h) for h in facts.response_headers or ()]
                floor.send(
                    (
                        facts.trace_id,
                        facts.span_id,
                        facts.parent_id,
                        facts.start_ns,
                        duration,
                        facts.status,
                        headers,
                        route,
                        snapshot,
                        facts.genai,
                    )
                )

        asgi.floor = self  # (the benchmark closes it with the app)
        return asgi

    def add_request_hook(self, op) -> None:
        """OutputProcessor.add_request: the engine request's state kept and registered, its traceparent set."""
        original = op.add_request
        floor = self

        def add_request(request, prompt, *args, **kwargs):
            result = original(request, prompt, *args, **kwargs)
            facts = _CURRENT.get()
            if facts is not None and facts.genai_span_id is not None:
                state = op.request_states.get(request.request_id)
                facts.states.append(state)
                floor.engine_requests[request.request_id] = facts
                request.trace_headers = {"traceparent": f"00-{facts.trace_id:032x}-{facts.genai_span_id:016x}-01"}
            return result

        op.add_request = add_request

    def handler_hook(self):
        floor = self

        async def hook(wrapped, instance, args, kwargs):
            request, raw_request = args
            facts = _CURRENT.get()
            if facts is None:
                return await wrapped(*args, **kwargs)
            values = request.__dict__
            fields = tuple(values.get(name) for name in contract.REQUEST_FIELD_NAMES)  # (what the request path reads)
            tenant = facts.headers.get(_TENANT_HEADER)
            facts.genai_span_id = random.getrandbits(64)
            facts.genai_start_ns = time.time_ns()
            result = await wrapped(*args, **kwargs)
            if hasattr(result, "__anext__"):
                return floor._stream(result, facts, fields, tenant, raw_request)
            floor._end(facts, fields, tenant, raw_request, result.choices[0].finish_reason)
            return result

        return hook

    async def _stream(self, chunks, facts, fields, tenant, raw_request):
        first = None
        async for chunk in chunks:
            if first is None:
                first = time.time_ns()
            yield chunk
        self._end(facts, fields, tenant, raw_request, "length", first)

    def _end(self, facts: Facts, fields: tuple, tenant, raw_request, finish_reason, first_chunk_ns=None) -> None:
        end_ns = time.time_ns()
        engines = [contract.read_engine_request(state) for state in facts.states]
        for engine in engines:
            self.engine_requests.pop(engine.request_id, None)
        first = engines[0]
        response_id = contract.read_response_metadata(raw_request)[1]
        input_tokens = sum(e.prompt_tokens for e in engines)
        cached = sum(e.cached_tokens for e in engines)
        output_tokens = sum(e.output_tokens or 0 for e in engines)
        tenant = tenant.decode() if tenant is not None else None
        model = fields[0]
        record = {
            semconv.USAGE_ID: f"floor/{first.prompt_id}",
            semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
            semconv.SERVICE_NAME: "vllm",
            semconv.SERVICE_INSTANCE_ID: "floor",
            semconv.VLLM_REQUEST_ID: first.external_id,
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.REQUEST_OUTCOME: "ok",
            semconv.USAGE_DURATION: (end_ns - facts.genai_start_ns) / 1e9,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            semconv.GEN_AI_REQUEST_CHOICE_COUNT: fields[2] or 1,
            semconv.USAGE_ENGINE_REQUEST_IDS: [e.request_id for e in engines],
            semconv.GEN_AI_REQUEST_MODEL: model,
            semconv.GEN_AI_RESPONSE_MODEL: model,
            semconv.GEN_AI_RESPONSE_ID: response_id,
            semconv.GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason],
            semconv.USAGE_TIME: end_ns,
            semconv.USAGE_TRACE_ID: f"{facts.trace_id:032x}",
            semconv.USAGE_SPAN_ID: f"{facts.genai_span_id:016x}",
        }
        if tenant is not None:
            record[semconv.TENANT_ID] = tenant
        os.write(self.spool, json_line(record))
        timing = [
            None
            if e.timing is None
            else (
                e.timing.queued,
                e.timing.scheduled,
                e.timing.first_token,
                e.timing.last_token,
                e.timing.first_token_latency,
                e.timing.generation_tokens,
                e.timing.preemptions,
            )
            for e in engines
        ]
        facts.genai = (
            facts.genai_span_id,
            facts.genai_start_ns,
            end_ns,
            fields,
            tenant,
            response_id,
            first.external_id,
            input_tokens,
            cached,
            output_tokens,
            finish_reason,
            first_chunk_ns,
            timing,
        )

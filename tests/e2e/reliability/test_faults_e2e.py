"""Faults in otel-llm's own code inside a real server, and an abort storm (issue 11, "Hardening").

One `opentelemetry-instrument vllm serve` for the module, with tests/e2e/reliability/fault_injector.py
loaded in it (see its docstring for how: an `opentelemetry_pre_instrument` entry point from a
temporary dist-info on PYTHONPATH, so opentelemetry-instrument's own sitecustomize stays in charge).
The injector can make any `_safe` guard of otel_llm.vllm.wrappers and streams, or any function we name, raise; the
test switches the active fault at run time through a file, so one server serves every target.

1. Every call into our code on a request path of the API server process gets a fault: each
   `_safe` guard (listed by the process itself: a new guard that no Target covers fails
   `test_every_guard_on_the_request_path_gets_a_fault`) and the functions the guards and wrappers
   call: request start (`_request_info`, attribution, `Telemetry.start`, the AsyncLLM fallback),
   making the record current and restoring the context, the traced mark, reading the response, a
   stream handed to its route and its chunks watched there, attaching an engine request, engine
   finished and aborted, the validation-rejection hook, `RequestTelemetry._end`, the usage record (`_write_usage`,
   the spool) and the metric key, and the HTTP layer's query redaction. For each
   target two chat requests, two streamed completions, two streams the client leaves and two
   requests FastAPI rejects are served complete (`[DONE]` included); the fault fired for each
   request that reaches it (the injector counts); what does not depend on the failing piece still
   arrives (HTTP spans always; the GenAI span, its tokens and phases, the abort marker, the usage
   record and the request counter wherever the target is not what makes them); each fault is logged
   at most once, never per request, and no other traceback appears. vLLM's calls into our
   stat-logger plugin are empty methods; the token counter's callback runs on the export thread.
2. Every entry point of otel-llm (a function of ours another library calls: the deferred spans,
   tracer and tracer provider the FastAPI instrumentation gets, its request hooks, uvicorn's
   access-log filter, vLLM's stat-logger plugin, the failure counter's callback; marked by
   otel_llm/warn.py `entry` / `inline_entry`, listed by the server process itself as the injector
   finds them, not here) gets a fault inside its guard, in the API server only, with the request
   plan above plus a request for an unknown model (404) and an n=2 chat: every response equals the
   no-fault baseline in status and body shape, the fault fired (except at ENTRIES_OFF_THIS_PATH),
   it was logged at most once, no traceback per request, and each failure is counted in
   otel_llm.instrumentation.failures under its point.
3. An abort storm on the same server: after a warm-up of 20, 100 streams of a 4000-token generation
   left by the client after 1-3 chunks, 10 at a time: one aborted GenAI span per request with its
   phases inside it, the aborted-requests counter equal to the spans, the API server's RSS growth
   bounded (printed: run with -s).

The server is paced (VLLMServer(paced=True): the tiny model's tokenizer on tiny_model.PACED_NETWORK,
vLLM's dummy weights). With the 2-layer tiny model the engine core emits a token per stream every
~2 ms, and on a loaded machine vLLM's API server falls behind its output socket: pyzmq hands it
ready messages without yielding the event loop, which then runs neither the SSE writers nor the
disconnect listeners until the engine stops. Measured here (2 cores shared with other test runs),
30 streams left after 2 chunks, 10 at a time: bare vLLM with the tiny model ran 24 of them to
max_tokens; next to 6 busy processes its 30 clients waited 4 minutes for their chunks. With this
network (a step ~10x longer) and the same 6 busy processes, every stream was aborted within 240 of
its 4000 tokens: the abort markers do not hang on the machine's speed.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import Traceparent, genai_spans

from devkit.devserver import VLLMServer, otlp_env
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing.ledger import read_spool

HERE = Path(__file__).resolve().parent
W = "otel_llm.vllm.wrappers"
S = "otel_llm.vllm.streams"
RT = "otel_llm.vllm.routes"
R = "otel_llm.vllm.request_telemetry"

MAX_MODEL_LEN = 4096
LONG_GENERATION = 4000  # tokens: no engine finishes these before the client leaves
SHORT_GENERATION = 5

CHAT, STREAM, ABORT, REJECT = "chat", "stream", "abort", "reject"
NOT_FOUND, N2 = "not_found", "n2"  # an unknown model (404), a chat with n=2
GENERATING = (CHAT, STREAM, ABORT)
EVERY = (CHAT, STREAM, ABORT, REJECT)
# requests sent per target: two of each kind, so that every fault fires at least twice and "logged
# once" means once for several faults
PLAN = (CHAT, STREAM, CHAT, STREAM, ABORT, ABORT, REJECT, REJECT)
HANDLER_STARTS = ("guard:starting the chat span", "guard:starting the text_completion span")


@dataclass(frozen=True)
class Target:
    """A place a fault is injected, and what is lost with it (everything else must still arrive)."""

    name: str  # "guard:<what>" (inside that _safe guard) or "module:attribute.path"
    fires: tuple[str, ...]  # the request kinds that reach it (each must make it raise)
    also: tuple[str, ...] = ()  # targets faulted at the same time
    no_span: tuple[str, ...] = ()  # kinds whose handler's GenAI span is lost
    # kinds that get the AsyncLLM hook's span instead (or besides): vLLM's generate() runs with no
    # request current (a text_completion span, without the request's attributes and tenant)
    fallback: tuple[str, ...] = ()
    no_engine: tuple[str, ...] = ()  # kinds whose spans have no engine request: no tokens, no usage record
    no_abort_marker: bool = False  # the abandoned streams' spans end as finished
    no_ledger: tuple[str, ...] = ()  # kinds without a usage record
    no_metrics: tuple[str, ...] = ()  # kinds not counted in otel_llm.server.requests
    bare: bool = False  # the spans end with their start attributes only (nothing from the end)
    no_wire_ttft: bool = False  # the stream's span lacks the first-chunk time
    guards: int = 1  # the guards that catch it, each logging it once
    # kinds whose span ends with the response, after its HTTP span (a stream's whose engine end never came:
    # its route ends it, otel_llm/vllm/routes.py `_finish`, or its proxy when dropped, streams.py)
    after_http: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return self.name.replace("guard:", "guard ").replace(":", ".").replace(" ", "_").replace("'", "")


TARGETS = (
    # request start: the handler wrapper's guard, and what it calls. vLLM's engine request then finds
    # no request current, and the route (otel_llm/vllm/routes.py) starts the request's span: tenant,
    # tokens, phases, abort marker and usage record, but not the request parameters or the stream's
    # first-chunk time. Without the route's scope too, the AsyncLLM hook would make its span (itself
    # faulted in the fourth target)
    Target("guard:starting the chat span", fires=(CHAT, ABORT)),
    Target("guard:starting the text_completion span", fires=(STREAM,), no_wire_ttft=True),
    Target(f"{W}:_request_info", fires=GENERATING, no_wire_ttft=True),
    Target(
        "guard:starting an AsyncLLM span",
        also=(*HANDLER_STARTS, "otel_llm.vllm.routes:_enter"),
        fires=GENERATING,
        no_span=GENERATING,
    ),
    # (the route's span takes no tenant then: it is counted as a span without one)
    Target("otel_llm.vllm.attribution:Attribution.caller", fires=EVERY, no_span=EVERY, fallback=GENERATING, guards=2),
    # the end user (`user` / `safety_identifier`): the handler's span is lost as with _request_info, and the
    # route's span (which reads it in its own try) takes over without it
    Target("otel_llm.vllm.attribution:Attribution.end_user", fires=GENERATING, no_wire_ttft=True, guards=2),
    # a configured conversation header (none here): its own guard, nothing else lost
    Target("guard:reading a request's conversation header", fires=GENERATING),
    Target(f"{R}:RequestTelemetry.__init__", fires=EVERY, no_span=EVERY),
    # making the record current around vLLM's code (handler, first chunk) and restoring the context:
    # not current, the route's scope still links the engine request to the handler's span
    Target("guard:making a request's span current", fires=GENERATING),
    Target(f"{S}:attach", fires=GENERATING),
    Target("guard:restoring the context after a request", fires=GENERATING),
    Target(f"{S}:detach", fires=GENERATING),
    # the mark that keeps an exception handler from recording a second (rejection) span
    Target("guard:marking a request as traced", fires=GENERATING),
    # the handler's result: unread, a stream is not wrapped (its span ends when the handler returns)
    Target("guard:reading a vLLM response", fires=GENERATING, no_engine=(STREAM, ABORT), no_abort_marker=True),
    Target("otel_llm.vllm.contract:read_result", fires=GENERATING, no_engine=(STREAM, ABORT), no_abort_marker=True),
    # a stream handed to its route (failing, the stream proxy of streams.py takes it), whose send watches
    # its chunks: the first one timed, and its end handed to its engine requests (failing, the route ends
    # it when the response is done, aborted where vLLM aborted its engine requests)
    Target(f"{RT}:take_stream", fires=(STREAM, ABORT)),
    Target(f"{R}:RequestTelemetry.on_first_chunk", fires=(STREAM, ABORT), no_wire_ttft=True, after_http=(STREAM,)),
    Target(f"{R}:RequestTelemetry.end_with_engines", fires=(STREAM, ABORT), after_http=(STREAM,)),
    # engine events (the output processor, in the API server process)
    Target("guard:attaching an engine request", fires=GENERATING, no_engine=GENERATING),
    Target(f"{W}:_attach", fires=GENERATING, no_engine=GENERATING),
    Target(f"{R}:RequestTelemetry.attach_engine_request", fires=GENERATING, no_engine=GENERATING),
    Target("guard:recording an engine finish", fires=(CHAT, STREAM), after_http=(STREAM,)),
    Target(f"{R}:RequestTelemetry.on_engine_finished", fires=(CHAT, STREAM), after_http=(STREAM,)),
    # (a stream's span then ends with the response, as finished: its route ends it, routes.py `_finish`)
    Target("guard:recording an engine abort", fires=(ABORT,), no_abort_marker=True),
    # the engine core's figures on a finished request's final output (otel_llm/vllm/engine_cost.py):
    # unread, the span has no otel_llm.cost.* (the ledger's engine record has them)
    Target("guard:reading an engine request's final output", fires=(CHAT, STREAM), after_http=(STREAM,)),
    # requests FastAPI rejects before a handler runs
    Target("guard:recording a rejected request", fires=(REJECT,), no_span=(REJECT,)),
    # the route layer (otel_llm/vllm/routes.py): chat and completions are handler-hooked, so the route
    # only scopes them; a fault there loses nothing
    Target("guard:claiming a request for its route", fires=GENERATING),
    Target("otel_llm.vllm.routes:_enter", fires=EVERY),
    Target("otel_llm.vllm.routes:_finish", fires=EVERY),
    # the end in the API server: the request's facts, usage record, metric key (the span's end attributes,
    # phase spans and measurement are built from the facts in the export process: a fault there is
    # tests/vllm/test_offload.py's)
    Target(f"{R}:RequestTelemetry._end", fires=EVERY, bare=True),
    Target(f"{R}:RequestTelemetry._write_usage", fires=GENERATING, no_ledger=GENERATING),
    Target("otel_llm.usage:Spool.write", fires=GENERATING, no_ledger=GENERATING),
    Target(f"{R}:RequestTelemetry._metric", fires=EVERY, no_metrics=EVERY),
)
# The HTTP layer's hooks on vLLM's app: the server span's request hook and uvicorn's access-log
# filter redact a URL's query (the chat requests have one). Run after everything else: a fault that
# escapes there breaks requests, and the checks above would fail for it.
HTTP_TARGETS = ()
if hasattr(importlib.import_module("otel_llm.vllm.http"), "redact_query"):
    HTTP_TARGETS = (Target("otel_llm.vllm.http:redact_query", fires=(CHAT,)),)

# `_safe` guards the server registers that no request of this server reaches, and why
GUARDS_OFF_THIS_PATH = {
    "starting an LLMEngine span": "offline vllm.LLM only (tests/e2e/test_offline_e2e.py)",
    "starting the embeddings span": "a pooling model's server (tests/e2e/test_embeddings_e2e.py); the same "
    "handler wrapper as chat and completions, faulted here",
    "starting a background response span": "Responses API background mode (tests/e2e/test_serving_paths_e2e.py)",
    "ending a background response span": "Responses API background mode (tests/e2e/test_serving_paths_e2e.py)",
    "redacting a vLLM logger's warnings": "when vLLM makes a logger (init_logger, as its modules are imported)",
    "ending a request's span on an exception": "an exception from vLLM's code for a request, or a stream that "
    "does not end with its engine requests (test_streams.py): this server's streams end with theirs",
    "recording a stream's first chunk": "the stream proxy's (streams.py), for a stream no route watches: "
    "AsyncLLM.generate used directly, or a route not wrapped (tests/vllm/test_streams.py); this server's "
    "routes watch theirs (routes.py `RouteScope.watch`, faulted here through on_first_chunk)",
    "handing a stream's end to its engine requests": "the stream proxy's, as the one above",
}

_MAINTAINED_CALL = "the maintained HTTP middleware's own call, which this server's requests do not take"

# entry points (otel_llm/warn.py) no request reaches, and why: their guards are checked by
# tests/names/test_entry_points.py and tests/vllm/test_offload.py
ENTRY = "entry:"
ENTRIES_OFF_THIS_PATH = {
    "otel_llm.vllm.stat_logger:KeepRequestStats.__init__": "when vLLM starts its engine",
    "otel_llm.vllm.stat_logger:KeepRequestStats.log_engine_initialized": "once, when the engine is up",
    "otel_llm.vllm.export.deferred:DeferredTracerProvider.get_tracer": (
        "when Starlette builds the app's middleware, at the server's first request (its readiness probe)"
    ),
    "otel_llm.vllm.export.channel:ExportChannel._after_fork": "in a process forked from the API server",
    "otel_llm.vllm.export.deferred:DeferredTracer.start_as_current_span": "no caller on this server",
    # this server's requests carry no trace context: their server spans and GenAI spans are made by
    # DeferredTracer.start_root_span and start_request_span, ours, inside LeanMiddleware._begin's and the
    # handler's guards (tests/vllm/test_offload.py sends a traceparent and baggage)
    "otel_llm.vllm.export.deferred:DeferredTracer.start_span": "a request with a trace context, a span another "
    "library starts, a GenAI span outside a recording server span (none here)",
    "otel_llm.vllm.export.deferred:DeferredSpan.is_recording": "start_span's, an exception escaping the app (none "
    "here); " + _MAINTAINED_CALL,
    "otel_llm.vllm.export.deferred:DeferredSpan.name": (
        "no caller on this server (read by other instrumentations' hooks)"
    ),
    "otel_llm.vllm.export.deferred:DeferredSpan.update_name": "no caller on this server",
    "otel_llm.vllm.export.deferred:DeferredSpan.add_event": "no caller on this server",
    "otel_llm.vllm.export.deferred:DeferredSpan.record_exception": "an exception escaping the app (none here)",
    # a GenAI span's attributes, read or set in the API server only by another library (none here)
    "otel_llm.vllm.export.deferred:RequestSpan.attributes": "no caller on this server",
    "otel_llm.vllm.export.deferred:RequestSpan.set_attribute": "no caller on this server",
    "otel_llm.vllm.export.deferred:RequestSpan.set_attributes": "no caller on this server",
    "otel_llm.vllm.wrappers:RedactingLogFilter.filter": "a warning or error of vLLM's loggers (none here)",
    "otel_llm.vllm.request_metrics:RequestMetrics._observe_tokens": "the metric reader's thread, in the export "
    "process here (it records the request metrics)",
    "otel_llm.vllm.request_metrics:RequestMetrics._observe_compute": "the metric reader's thread, in the export "
    "process here (it records the request metrics)",
    "otel_llm.vllm.request_metrics:RequestMetrics._observe_spec_drafts": "the metric reader's thread, in the export "
    "process here",
    "otel_llm.vllm.request_metrics:RequestMetrics._observe_spec_accepted": "the metric reader's thread, in the "
    "export process here",
    "otel_llm.vllm.export.http:_InstrumentConflict.filter": "once, when Starlette builds the app's middleware (the "
    "SDK's warning about the active-requests counter made again)",
    "otel_llm.vllm.telemetry:observe_failures": "the metric reader's thread, every second (it may or may not fire in "
    "a target's time)",
    # this server's HTTP requests take the replayed path (export/http.py HeldUntilRecorded.__call__); the
    # maintained middleware's own __call__ (a websocket, a request inside another span) is faulted in
    # tests/vllm/test_offload.py
    "otel_llm.vllm.export.http:release": _MAINTAINED_CALL,
    # the replayed path's server span ends as a ServerSpan (its own guard), and a GenAI span is handed over
    # unended here (its end is built in the export process)
    "otel_llm.vllm.export.deferred:DeferredSpan.end": "a span of ours ended in the API server: in the export "
    "process here (request_facts.build); " + _MAINTAINED_CALL,
    "otel_llm.vllm.http:LeanMiddleware._get_otel_send": _MAINTAINED_CALL,
    "otel_llm.vllm.export.http:ReplayingMiddleware._get_otel_send": _MAINTAINED_CALL,
    "otel_llm.vllm.export.http:DeferredHistogram.record": _MAINTAINED_CALL,
    # the replayed path counts active requests by a kept key (ActiveRequests.add_key, inside LeanMiddleware._begin
    # and _finish's guards), and asks the propagators (their getter) only for a request that carries a traceparent
    # or baggage header (none here: tests/vllm/test_offload.py sends both)
    "otel_llm.vllm.export.http:ActiveRequests.add": _MAINTAINED_CALL,
    "otel_llm.vllm.export.http:_HeaderGetter.get": "a request with a traceparent or baggage header (none here), "
    + _MAINTAINED_CALL,
    "otel_llm.vllm.http:hold_nothing_hook": _MAINTAINED_CALL,
    "otel_llm.vllm.http:redacting_hold_nothing_hook": _MAINTAINED_CALL,
    "otel_llm.vllm.export.deferred:DeferredSpan.kind": _MAINTAINED_CALL,
    "otel_llm.vllm.export.deferred:DeferredSpan.attributes": _MAINTAINED_CALL,
    "otel_llm.vllm.export.deferred:DeferredSpan.set_attribute": _MAINTAINED_CALL,
    # a GenAI request's end is built in the export process here (otel_llm/vllm/request_facts.py build), and
    # the maintained middleware's own __call__ sets the HTTP span's
    "otel_llm.vllm.export.deferred:DeferredSpan.set_attributes": "in the export process here (request_facts.build); "
    + _MAINTAINED_CALL,
    "otel_llm.vllm.export.deferred:DeferredSpan.set_status": "in the export process here (request_facts.build) on an "
    "error; " + _MAINTAINED_CALL,
    "otel_llm.vllm.http:redact_query_hook": "in the export process here (the replayed middleware's hook); the access "
    "log's filter, under the same guard, is faulted here",
}

# the first line of a log record (vLLM's, uvicorn's, ours), as opposed to a traceback's lines
LOG_RECORD = re.compile(r"^(?:(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)[: ]|\((?:APIServer|EngineCore))")
_TENANT_NUMBERS = itertools.count()
_results: dict[str, dict] = {}  # target name -> what its test sent, for the module's final checks


class Faults:
    """The injector's switch and log, and the server it runs in."""

    def __init__(self, directory: Path):
        self.switch = directory / "active"
        self.log = directory / "events"
        self.switch.write_text("")

    def set(self, *names: str) -> None:
        tmp = self.switch.with_suffix(".tmp")
        tmp.write_text("\n".join(names))
        os.replace(tmp, self.switch)  # the server reads it whole or not at all

    def events(self, kind: str, pid: int) -> list[str]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            k, p, name = line.split(" ", 2)
            if k == kind and int(p) == pid:
                out.append(name)
        return out


@pytest.fixture(scope="module")
def setup(receiver, tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    plugin = base / "plugin"
    info = plugin / "otel_llm_fault_injector-0.dist-info"
    info.mkdir(parents=True)
    shutil.copy(HERE / "fault_injector.py", plugin / "fault_injector.py")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otel-llm-fault-injector\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[opentelemetry_pre_instrument]\notel_llm_fault_injector = fault_injector:install\n"
    )
    faults = Faults(base)
    usage_dir = base / "usage"
    python_path = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    env = {
        "PYTHONPATH": python_path,
        "OTEL_LLM_TEST_FAULT_FILE": str(faults.switch),
        "OTEL_LLM_TEST_FAULT_LOG": str(faults.log),
        "OTEL_LLM_TEST_FAULT_TARGETS": ",".join(
            t.name for t in TARGETS + HTTP_TARGETS if not t.name.startswith("guard:")
        ),
        "OTEL_LLM_USAGE_DIR": str(usage_dir),
        # (content capture on: the configuration the fault run of issue 20 found a fault in)
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "span_only",
    }
    server = VLLMServer(
        env={**otlp_env(receiver.endpoint), **env},
        paced=True,
        extra_args=["--max-model-len", str(MAX_MODEL_LEN)],
        log_path=base / "vllm-faults.log",
    )
    server.start()
    server.faults = faults
    server.usage_dir = usage_dir
    server.api_pid = api_server_pid(server)
    yield server
    server.stop()


def api_server_pid(server) -> int:
    """The API server: the process `opentelemetry-instrument` exec'ed into `vllm serve` (the engine
    core and its worker are its children)."""
    pids = server.pids()
    assert server.process.pid in pids
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().split(b"\0")
    assert any(part.endswith(b"vllm") for part in cmdline) and b"serve" in cmdline, cmdline
    return server.process.pid


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


# --- requests ----------------------------------------------------------------------------------


def send_chat(server, tp, tenant):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "fault injection"}],
        "max_tokens": SHORT_GENERATION,
        "ignore_eos": True,
        "temperature": 0,
    }
    # (a query string: the HTTP layer's query redaction runs for it)
    r = httpx.post(
        server.url + "/v1/chat/completions?probe=1",
        json=body,
        headers=tp.headers(**{"x-tenant-id": tenant}),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    data = r.json()
    (choice,) = data["choices"]
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == SHORT_GENERATION
    return data["usage"]


def send_stream(server, tp, tenant):
    body = {
        "model": MODEL_NAME,
        "prompt": "fault injection streams",
        "max_tokens": SHORT_GENERATION,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines = []
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", server.url + "/v1/completions", json=body, headers=tp.headers(**{"x-tenant-id": tenant})
        ) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(isinstance(c["choices"][0]["text"], str) for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == SHORT_GENERATION
    return usage


def send_abandoned_stream(server, tp, tenant, chunks=2):
    """A long stream the client leaves after `chunks` data chunks."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "a very long story"}],
        "max_tokens": LONG_GENERATION,
        "ignore_eos": True,
        "stream": True,
    }
    received = 0
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", server.url + "/v1/chat/completions", json=body, headers=tp.headers(**{"x-tenant-id": tenant})
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert line != "data: [DONE]", f"a {LONG_GENERATION}-token stream ended before the client left"
                    json.loads(line[len("data: ") :])
                    received += 1
                    if received == chunks:
                        break
    assert received == chunks
    return None


def send_rejected(server, tp, tenant):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": "tiny-llama", "messages": [',
        headers=tp.headers(**{"x-tenant-id": tenant, "content-type": "application/json"}),
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"]
    return None


SENDERS = {CHAT: send_chat, STREAM: send_stream, ABORT: send_abandoned_stream, REJECT: send_rejected}


def send_plan(server, tenant):
    """PLAN's requests: a chat and a stream one after the other, then the others together.
    Returns [(kind, traceparent, usage or None)]."""
    sent = []
    for kind in (CHAT, STREAM):
        tp = Traceparent()
        sent.append((kind, tp, SENDERS[kind](server, tp, tenant)))
    rest = list(PLAN)
    rest.remove(CHAT)
    rest.remove(STREAM)
    rest = [(kind, Traceparent()) for kind in rest]
    with ThreadPoolExecutor(len(rest)) as pool:
        futures = [pool.submit(SENDERS[kind], server, tp, tenant) for kind, tp in rest]
        for (kind, tp), future in zip(rest, futures):
            sent.append((kind, tp, future.result()))
    return sent


def wait_for_traces(receiver, sent, spans_expected):
    """Each request's HTTP server span, and as many GenAI spans as are expected."""

    def missing(traces):
        return [
            (kind, [s.name for s in traces.get(tp.trace_id, [])])
            for kind, tp, _ in sent
            if not any(s.kind == "SERVER" for s in traces.get(tp.trace_id, []))
            or len(genai_spans(traces.get(tp.trace_id, []))) < spans_expected(kind)
        ]

    def ready(rx):
        traces = rx.traces()
        return None if missing(traces) else {tp.trace_id: traces[tp.trace_id] for _, tp, _ in sent}

    try:
        return receiver.wait_for(ready, timeout=120)
    except TimeoutError:
        raise AssertionError(
            f"spans missing after 120 s (kind, spans that arrived): {missing(receiver.traces())}"
        ) from None


# --- the faults --------------------------------------------------------------------------------


def test_every_guard_on_the_request_path_gets_a_fault(setup):
    registered = set(setup.faults.events("registered", setup.api_pid))
    guards = {name[len("guard:") :] for name in registered if name.startswith("guard:")}
    faulted = {t.name[len("guard:") :] for t in TARGETS if t.name.startswith("guard:")}
    assert faulted <= guards, f"guards no longer in otel_llm.vllm.wrappers or streams: {faulted - guards}"
    unknown = guards - faulted - set(GUARDS_OFF_THIS_PATH)
    assert not unknown, f"new _safe guards: add a Target (or GUARDS_OFF_THIS_PATH) for {unknown}"
    functions = {t.name for t in TARGETS + HTTP_TARGETS if not t.name.startswith("guard:")}
    assert functions <= registered, functions - registered


def test_baseline_without_faults(setup, receiver):
    _check_target(setup, receiver, Target("", fires=()))


@pytest.mark.parametrize("target", TARGETS, ids=[t.id for t in TARGETS])
def test_fault_is_contained(setup, receiver, target):
    _check_target(setup, receiver, target)


def _check_target(server, receiver, target: Target):
    tenant = f"fault-{next(_TENANT_NUMBERS)}"  # (not len(_results): a failed target records no result)
    hits_before = len(server.faults.events("hit", server.api_pid))
    server.faults.set(target.name, *target.also)
    try:
        sent = send_plan(server, tenant)
        traces = wait_for_traces(receiver, sent, lambda kind: (kind not in target.no_span) + (kind in target.fallback))
        # (an abandoned stream's end, and vLLM's abort, come after the client has gone)
        reaching = sum(1 for kind in PLAN if kind in target.fires)
        try:
            receiver.wait_for(lambda rx: len(server.faults.events("hit", server.api_pid)) - hits_before >= reaching)
        except TimeoutError:
            pass
    finally:
        server.faults.set()
    _results[target.name] = {"tenant": tenant, "sent": sent, "target": target}
    hits = server.faults.events("hit", server.api_pid)[hits_before:]
    assert set(hits) <= {target.name, *target.also}
    assert len(hits) >= reaching, f"the fault fired {len(hits)} times; {reaching} requests reach it"

    ledger = {}
    for record in read_spool(str(server.usage_dir)):
        ledger.setdefault(record.get(semconv.USAGE_TRACE_ID), []).append(record)
    for kind, tp, usage in sent:
        spans = traces[tp.trace_id]
        (http,) = [s for s in spans if s.kind == "SERVER"]
        genai = genai_spans(spans)
        where = f"{target.name or 'no fault'}, {kind} request"
        handler = [s for s in genai if s.attributes.get(semconv.TENANT_ID) == tenant]
        fallback = [s for s in genai if semconv.TENANT_ID not in s.attributes]
        assert len(handler) + len(fallback) == len(genai), where
        assert len(handler) == (kind not in target.no_span), where
        assert len(fallback) == (kind in target.fallback), where
        engine = kind != REJECT and kind not in target.no_engine
        records = ledger.get(tp.trace_id, [])
        if engine and genai and not target.bare and kind not in target.no_ledger:
            assert len(records) == 1, f"{where}: {len(records)} usage records"
            (record,) = records
            assert record.get(semconv.TENANT_ID) == (tenant if handler else None), where
            assert (
                record[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
                == (handler or fallback)[0].attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
            ), where
        else:
            assert records == [], where
        for span in genai:
            _check_span(target, kind, span, http, spans, usage, engine, where)
            if span in handler and kind == STREAM and engine and not target.bare:
                assert (semconv.VLLM_STREAM_TTFT_SECONDS in span.attributes) is not target.no_wire_ttft, where


def _check_span(target, kind, span, http, spans, usage, engine, where):
    assert span.parent_span_id == http.span_id, where
    if kind != ABORT and kind not in target.after_http:  # (an abandoned stream's span may end after its HTTP span)
        assert http.start_ns <= span.start_ns <= span.end_ns <= http.end_ns, where
    elif kind in target.after_http:
        assert http.start_ns <= span.start_ns <= http.end_ns <= span.end_ns, where
    phases = [s for s in spans if s.parent_span_id == span.span_id]
    for phase in phases:
        assert span.start_ns <= phase.start_ns <= phase.end_ns <= span.end_ns, where
    attrs = span.attributes
    if target.bare:
        assert semconv.GEN_AI_USAGE_INPUT_TOKENS not in attrs and semconv.ERROR_TYPE not in attrs, where
        return
    if usage is not None and engine:
        assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"], where
        assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"], where
        assert semconv.ERROR_TYPE not in attrs, where
    if kind == ABORT:
        if target.no_abort_marker:
            assert semconv.VLLM_ABORTED not in attrs, where
        else:
            assert attrs.get(semconv.VLLM_ABORTED) is True, (where, (span.end_ns - span.start_ns) / 1e9, attrs)
            assert attrs[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED, where
    if kind == REJECT:
        assert attrs[semconv.ERROR_TYPE] == "Bad Request", where
    if engine and kind != ABORT:
        assert tuple(s.name for s in sorted(phases, key=lambda s: s.start_ns)) == semconv.PHASE_SPANS, where
        assert semconv.VLLM_DECODE_SECONDS in attrs, where


def test_faults_are_logged_once_and_counted_where_unaffected(setup, receiver):
    """Each fault fired several times and was logged at most once (one warning per guard, never one
    per request); the request counter counts every request whose end was not the failing piece."""
    assert _results, "run with the fault tests"
    log = setup.log_path.read_text(errors="replace")
    hits = setup.faults.events("hit", setup.api_pid)
    for name, result in _results.items():
        if name:
            assert hits.count(name) >= 2, name
            assert log.count(f"InjectedFault: {name}\n") <= result["target"].guards, f"{name} logged per request"
    _check_log(log)

    expected = {}  # the handler's spans are counted under the request's tenant
    for result in _results.values():
        target = result["target"]
        expected[result["tenant"]] = sum(
            1
            for kind, _, _ in result["sent"]
            if kind not in target.no_span and not target.bare and kind not in target.no_metrics
        )

    def counted(rx):
        found = {}
        for p in rx.latest_metrics():
            if p.name == semconv.SERVER_REQUESTS and p.attributes.get(semconv.TENANT_ID) in expected:
                tenant = p.attributes[semconv.TENANT_ID]
                found[tenant] = found.get(tenant, 0) + p.value
        return found if all(found.get(t, 0) == n for t, n in expected.items()) else None

    try:
        receiver.wait_for(counted, timeout=30)
    except TimeoutError:
        found = {}
        for p in receiver.latest_metrics():
            if p.name == semconv.SERVER_REQUESTS and p.attributes.get(semconv.TENANT_ID) in expected:
                found[p.attributes[semconv.TENANT_ID]] = found.get(p.attributes[semconv.TENANT_ID], 0) + p.value
        names = {r["tenant"]: n for n, r in _results.items()}
        raise AssertionError(
            {names[t]: (found.get(t, 0), n) for t, n in expected.items() if found.get(t, 0) != n}
        ) from None


def _check_log(log: str) -> None:
    """Each otel-llm warning once; every traceback is part of one (with the exceptions it chains)."""
    warnings = [line.split("otel-llm: ", 1)[1] for line in log.splitlines() if "otel-llm: " in line]
    assert len(warnings) == len(set(warnings)), sorted(warnings)
    record = ""
    for line in log.splitlines():
        if LOG_RECORD.match(line):
            record = line
        elif line.startswith("Traceback (most recent call last)"):
            assert "otel-llm: " in record, f"a traceback after {record!r}"
    for marker in ("Exception in ASGI application", "Exception ignored in", "Task exception was never retrieved"):
        assert marker not in log


# --- the abort storm ---------------------------------------------------------------------------


def _abandon_all(server, tenant, count, seed):
    rng = random.Random(seed)
    plan = [(Traceparent(), rng.randint(1, 3)) for _ in range(count)]
    with ThreadPoolExecutor(10) as pool:
        for future in [pool.submit(send_abandoned_stream, server, tp, tenant, n) for tp, n in plan]:
            future.result()
    return [tp for tp, _ in plan]


def _aborted_spans(receiver, traceparents):
    ids = {tp.trace_id for tp in traceparents}

    def all_there(rx):
        traces = rx.traces()
        found = {t: genai_spans(traces.get(t, [])) for t in ids}
        return found if all(found.values()) else None

    try:
        return receiver.wait_for(all_there, timeout=60)
    except TimeoutError:
        traces = receiver.traces()
        missing = [t for t in ids if not genai_spans(traces.get(t, []))]
        raise AssertionError(
            f"{len(missing)} of {len(ids)} abandoned streams have no GenAI span (never ended?)"
        ) from None


def _requests_counted(receiver, tenant):
    by_outcome = {}
    for p in receiver.latest_metrics():
        if p.name == semconv.SERVER_REQUESTS and p.attributes.get(semconv.TENANT_ID) == tenant:
            outcome = p.attributes[semconv.REQUEST_OUTCOME]
            by_outcome[outcome] = by_outcome.get(outcome, 0) + p.value
    return by_outcome


def test_abort_storm(setup, receiver):
    server = setup
    server.faults.set("")
    _aborted_spans(receiver, _abandon_all(server, "storm-warmup", 20, seed=1))
    rss_before = rss_mib(server.api_pid)

    storm = _abandon_all(server, "storm", 100, seed=2)
    found = _aborted_spans(receiver, storm)
    # after one more metric export, nothing more may come: exactly one span per request
    receiver.wait_for(lambda rx: _requests_counted(rx, "storm").get(semconv.OUTCOME_ABORTED, 0) >= len(storm))
    rss_after = rss_mib(server.api_pid)
    print(
        f"\nabort storm: {len(storm)} streams abandoned after 20 warm-up ones; API server (pid {server.api_pid}) "
        f"RSS {rss_before:.1f} MiB -> {rss_after:.1f} MiB ({rss_after - rss_before:+.1f} MiB)"
    )

    traces = receiver.traces()
    finished = []
    for tp in storm:
        spans = traces[tp.trace_id]
        genai = genai_spans(spans)
        assert len(genai) == 1, f"{len(genai)} GenAI spans for one request"
        (span,) = genai
        (http,) = [s for s in spans if s.kind == "SERVER"]
        assert span.parent_span_id == http.span_id
        attrs = span.attributes
        if attrs.get(semconv.VLLM_ABORTED) is not True:
            finished.append(attrs.get(semconv.GEN_AI_RESPONSE_FINISH_REASONS))
            continue
        assert attrs[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED
        assert span.status == "ERROR"
        assert 1 <= attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] < LONG_GENERATION
        phases = [s for s in spans if s.parent_span_id == span.span_id]
        assert phases and {s.name for s in phases} <= set(semconv.PHASE_SPANS)
        for phase in phases:
            assert span.start_ns <= phase.start_ns <= phase.end_ns <= span.end_ns
    assert not finished, (
        f"{len(finished)} streams ended without the server seeing the client leave "
        f"(finish reasons {finished[:5]}): the engine finished {LONG_GENERATION} tokens first?"
    )
    assert sum(len(v) for v in found.values()) == len(storm)

    counted = _requests_counted(receiver, "storm")
    assert counted == {semconv.OUTCOME_ABORTED: len(storm)}, counted
    assert rss_after - rss_before < 100, f"RSS grew {rss_after - rss_before:.1f} MiB over {len(storm)} aborts"


# --- the HTTP layer (last: see HTTP_TARGETS) ---------------------------------------------------


@pytest.mark.parametrize("target", HTTP_TARGETS, ids=[t.id for t in HTTP_TARGETS])
def test_fault_in_the_http_layer_is_contained(setup, receiver, target):
    _check_target(setup, receiver, target)
    log = setup.log_path.read_text(errors="replace")
    assert log.count(f"InjectedFault: {target.name}\n") <= 1
    assert "Exception in ASGI application" not in log


# --- entry points: every function of ours another library calls (issue 20; last, as the HTTP layer) ---


def shape(value):
    """A JSON value with every scalar replaced by its type's name."""
    if isinstance(value, dict):
        return {key: shape(v) for key, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def _chunk_shapes(lines: list[str]) -> list[str]:
    return sorted(
        {
            json.dumps(shape(json.loads(line[len("data: ") :])), sort_keys=True)
            for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"
        }
    )


def probe(server, kind: str):
    """One request of `kind`: (status, the shape of what came back)."""
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "fault injection"}],
        "max_tokens": SHORT_GENERATION,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.Client(timeout=60) as client:
        if kind in (CHAT, N2, NOT_FOUND):
            body = {
                **chat,
                **({"n": 2, "temperature": 1.0} if kind == N2 else {}),
                **({"model": "no-such-model"} if kind == NOT_FOUND else {}),
            }
            r = client.post(server.url + "/v1/chat/completions?probe=1", json=body)
            return r.status_code, shape(r.json())
        if kind == REJECT:
            r = client.post(
                server.url + "/v1/chat/completions",
                content=b'{"model": "tiny-llama", "messages": [',
                headers={"content-type": "application/json"},
            )
            return r.status_code, shape(r.json())
        if kind == STREAM:
            body = {
                "model": MODEL_NAME,
                "prompt": "fault injection streams",
                "max_tokens": SHORT_GENERATION,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", server.url + "/v1/completions?probe=1", json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            return r.status_code, (_chunk_shapes(lines), lines[-1:] == ["data: [DONE]"])
        # ABORT: a long stream left after two chunks
        body = {**chat, "max_tokens": LONG_GENERATION, "stream": True}
        lines = []
        with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        break
        return r.status_code, _chunk_shapes(lines)


ENTRY_PLAN = (*PLAN, NOT_FOUND, N2)


def probe_plan(server) -> dict[str, list]:
    """ENTRY_PLAN's requests (a chat and a stream first, then the others together): kind -> what each got."""
    got: dict[str, list] = {}
    rest = list(ENTRY_PLAN)
    for kind in (CHAT, STREAM):
        rest.remove(kind)
        got.setdefault(kind, []).append(probe(server, kind))
    with ThreadPoolExecutor(len(rest)) as pool:
        for kind, result in zip(rest, pool.map(lambda k: probe(server, k), rest)):
            got.setdefault(kind, []).append(result)
    return got


def _failures_counted(receiver, pid: int) -> dict[str, float]:
    return {
        p.attributes.get(semconv.FAILURE_POINT): p.value
        for p in receiver.latest_metrics()
        if p.name == semconv.INSTRUMENTATION_FAILURES and p.resource.get("process.pid") == pid
    }


def test_a_fault_in_any_entry_point_is_contained(setup, receiver):
    server, pid = setup, setup.api_pid
    targets = sorted({n for n in server.faults.events("registered", pid) if n.startswith(ENTRY)})
    what = dict(line.split(" ", 1) for line in server.faults.events("what", pid))
    names = {t[len(ENTRY) :] for t in targets}
    assert "otel_llm.vllm.export.deferred:DeferredTracer.start_span" in names, "the injector found no entry points"
    assert set(ENTRIES_OFF_THIS_PATH) <= names, set(ENTRIES_OFF_THIS_PATH) - names
    server.faults.set()
    baseline = probe_plan(server)
    assert baseline[CHAT][0][0] == 200 and baseline[N2][0][0] == 200 and baseline[NOT_FOUND][0][0] == 404, baseline
    assert baseline[STREAM][0][1][1] and baseline[REJECT][0][0] == 400, baseline
    expected = {kind: [results[0]] * len(results) for kind, results in baseline.items()}

    problems, hits_by_point = [], {}
    for target in targets:
        hits_before = len(server.faults.events("hit", pid))
        server.faults.set(target, f"pid={pid}")
        try:
            got = probe_plan(server)
            if target[len(ENTRY) :] not in ENTRIES_OFF_THIS_PATH:
                try:
                    receiver.wait_for(lambda rx, n=hits_before: len(server.faults.events("hit", pid)) > n, timeout=10)
                except TimeoutError:
                    pass
        finally:
            server.faults.set()
        hits = server.faults.events("hit", pid)[hits_before:]
        if got != expected:
            problems.append(f"{target}: responses {got} differ from {expected}")
        if set(hits) - {target}:
            problems.append(f"{target}: other faults fired: {set(hits) - {target}}")
        if not hits and target[len(ENTRY) :] not in ENTRIES_OFF_THIS_PATH:
            problems.append(f"{target}: no request reached it (ENTRIES_OFF_THIS_PATH?)")
        point = what[target]
        hits_by_point[point] = hits_by_point.get(point, 0) + len(hits)
        try:
            receiver.wait_for(
                lambda rx, p=point, n=hits_by_point[point]: _failures_counted(rx, pid).get(p, 0) >= n, timeout=15
            )
        except TimeoutError:
            problems.append(
                f"{target}: {hits_by_point[point]} failures of {point!r}, counted "
                f"{_failures_counted(receiver, pid).get(point, 0)}"
            )
    log = setup.log_path.read_text(errors="replace")
    for target in targets:
        if log.count(f"InjectedFault: {target}\n") > 1:
            problems.append(f"{target}: logged {log.count(f'InjectedFault: {target}')} times")
    print(f"\n{len(targets)} entry points faulted; hits by point: {hits_by_point}")
    assert not problems, "\n".join(problems)
    _check_log(log)

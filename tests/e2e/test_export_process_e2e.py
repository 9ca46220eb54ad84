"""The export process on a real `opentelemetry-instrument vllm serve` (issue 14).

Two servers, the same requests: one with the default export process, one with
OTEL_LLM_EXPORT_PROCESS=false (the SDK in the API server). What reaches the collector must be
the same: span names, tree, attributes (except ids and timings), resource, metric series and
usage events. Then the export process is stopped and killed under the server: requests are
served all along, a stopped one catches up, a killed one is counted and restarted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from helpers import Traceparent, export_processes, genai_spans, request_trace, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv

USAGE_ENV = {"OTEL_LLM_USAGE_EVENTS": "true", "OTEL_LOGS_EXPORTER": "otlp"}
# values that differ between any two requests (ids, clocks)
VOLATILE = {
    semconv.GEN_AI_RESPONSE_ID,
    semconv.VLLM_REQUEST_ID,
    semconv.VLLM_QUEUE_SECONDS,
    semconv.VLLM_PREFILL_SECONDS,
    semconv.VLLM_DECODE_SECONDS,
    semconv.VLLM_TTFT_SECONDS,
    semconv.VLLM_SCHEDULED_TTFT_SECONDS,
    semconv.VLLM_TPOT_SECONDS,
    semconv.VLLM_STREAM_TTFT_SECONDS,
    semconv.USAGE_ID,
    semconv.USAGE_DURATION,
    semconv.USAGE_TIME,
    semconv.USAGE_ENGINE_REQUEST_IDS,
    semconv.COST_COMPUTE_NS,
    semconv.COST_PREFILL_COMPUTE_NS,
    semconv.COST_KV_BLOCK_NS,
    semconv.COST_KV_HIT_BLOCK_NS,
    semconv.COST_PREEMPTED_NS,
}
# the resource attributes of one server (its port, its process)
PER_SERVER = {semconv.SERVICE_INSTANCE_ID, "process.pid"}


@pytest.fixture(scope="module")
def servers(receiver, tmp_path_factory):
    started = {}
    try:
        started["export"] = start_server(receiver, tmp_path_factory, "export", env=USAGE_ENV)
        started["inprocess"] = start_server(
            receiver, tmp_path_factory, "inprocess", env={**USAGE_ENV, "OTEL_LLM_EXPORT_PROCESS": "false"}
        )
        yield started
    finally:
        for server in started.values():
            server.stop()


def chat(server, tenant: str, stream: bool) -> tuple[Traceparent, httpx.Response]:
    tp = Traceparent()
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "temperature": 0,
        "seed": 7,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(
        server.url + "/v1/chat/completions", json=body, timeout=120, headers=tp.headers(**{"x-tenant-id": tenant})
    )
    assert response.status_code == 200, response.text
    return tp, response


def shape(spans, port: int) -> list[tuple]:
    """A trace as (name, kind, parent's name, scope, status, events, attributes without volatile
    values), sorted. The HTTP span's attributes hold the server's port (made `PORT`) and the
    client's (its type only)."""
    by_id = {s.span_id: s for s in spans}
    out = []
    for s in spans:
        parent = by_id.get(s.parent_span_id)
        attrs = {}
        for k, v in s.attributes.items():
            if k in VOLATILE or k.endswith(("peer.port", "client.port")):
                v = type(v).__name__
            elif isinstance(v, str):
                v = v.replace(str(port), "PORT")
            elif v == port:
                v = "PORT"
            attrs[k] = v
        out.append(
            (s.name, s.kind, parent.name if parent else None, s.scope, s.status, s.events, sorted(attrs.items()))
        )
    return sorted(out, key=repr)


def resource(span) -> dict:
    return {k: v for k, v in span.resource.items() if k not in PER_SERVER}


def series(receiver, pid: int, tenant: str) -> dict[tuple, float]:
    """Our request metrics of one API server and tenant: (name, attributes) -> value or count."""
    out = {}
    for p in receiver.latest_metrics():
        spec = semconv.METRICS.get(p.name)
        if spec is None or semconv.VLLM not in spec.emitted_by or p.resource.get("process.pid") != pid:
            continue
        if p.attributes.get(semconv.TENANT_ID) != tenant:
            continue
        out[(p.name, tuple(sorted(p.attributes.items())))] = p.value if p.kind != "histogram" else p.count
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["chat", "stream"])
def test_the_export_process_exports_what_the_sdk_exported_in_process(servers, receiver, stream):
    traces = {}
    for name, server in servers.items():
        tp, _ = chat(server, f"same-{name}-{stream}", stream)
        traces[name] = request_trace(receiver, tp.trace_id)
    tenants = {name: f"same-{name}-{stream}" for name in servers}

    def same_tenant(trace, name):  # the tenants differ by design; the rest must not
        return [
            (*head, [(a, "T" if v == tenants[name] else v) for a, v in attrs])
            for *head, attrs in shape(trace, servers[name].port)
        ]

    assert same_tenant(traces["export"], "export") == same_tenant(traces["inprocess"], "inprocess")
    for name, spans in traces.items():
        (genai,) = genai_spans(spans)
        (http,) = [s for s in spans if s.kind == "SERVER"]
        # the export process's spans carry the API server's resource, not their own process's
        assert genai.resource == http.resource, name
        assert resource(genai) == resource(traces["inprocess"][0]), name

    pids = {name: genai_spans(traces[name])[0].resource["process.pid"] for name in servers}
    assert pids["export"] in export_processes(servers["export"]).values()
    assert export_processes(servers["inprocess"]) == {}

    def both_counted(rx):
        got = {name: series(rx, pids[name], tenants[name]) for name in servers}
        return got if all(got.values()) and all(len(v) == len(got["inprocess"]) for v in got.values()) else None

    got = receiver.wait_for(both_counted)
    strip = {
        name: {
            (n, tuple((k, "T" if v == tenants[name] else v) for k, v in attrs)): value
            for (n, attrs), value in got[name].items()
        }
        for name in servers
    }
    assert strip["export"] == strip["inprocess"]

    events = {}
    for name in servers:
        trace_id = genai_spans(traces[name])[0].trace_id
        events[name] = receiver.wait_for(
            lambda rx, t=trace_id: [e for e in rx.logs if e.trace_id == t and e.event_name == semconv.USAGE_EVENT]
        )
    for name, (event,) in events.items():
        assert event.span_id == genai_spans(traces[name])[0].span_id
    (a,), (b,) = events["export"], events["inprocess"]
    assert {k: v for k, v in a.attributes.items() if k not in VOLATILE | PER_SERVER and v != tenants["export"]} == {
        k: v for k, v in b.attributes.items() if k not in VOLATILE | PER_SERVER and v != tenants["inprocess"]
    }


def test_a_stopped_export_process_does_not_hold_requests_up(servers, receiver):
    server = servers["export"]
    (child,) = export_processes(server)
    os.kill(child, signal.SIGSTOP)
    try:
        sent = [chat(server, "stopped", stream=i % 2 == 1)[0] for i in range(4)]  # served while it is stopped
        assert not any(genai_spans(receiver.traces().get(tp.trace_id, [])) for tp in sent)
    finally:
        os.kill(child, signal.SIGCONT)
    for tp in sent:  # then it catches up: nothing was lost
        request_trace(receiver, tp.trace_id)


def test_a_killed_export_process_is_counted_and_restarted(servers, receiver):
    server = servers["export"]
    (child,) = export_processes(server)
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _exited(child) and time.monotonic() < deadline:  # its socket is closed once it exited
        time.sleep(0.01)
    lost, _ = chat(server, "killed", stream=False)  # served; its telemetry finds no export process
    api_pid = export_processes(server).get(child) or next(iter(export_processes(server).values()), None)

    def dropped(rx):
        return (
            sum(
                p.value
                for p in rx.latest_metrics()
                if p.name == semconv.EXPORT_DROPPED
                and p.attributes.get(semconv.ERROR_TYPE) == semconv.EXPORT_DROP_EXPORTER_DOWN
            )
            or None
        )

    assert receiver.wait_for(dropped) >= 1

    def restarted(rx):  # the next requests after the backoff (1 s) start a new one
        tp, _ = chat(server, "restarted", stream=False)
        try:
            return request_trace(rx, tp.trace_id, timeout=2)
        except TimeoutError:
            return None

    spans = receiver.wait_for(restarted, timeout=60)
    (genai,) = genai_spans(spans)
    assert genai.attributes[semconv.TENANT_ID] == "restarted"
    children = export_processes(server)
    assert len(children) == 1 and child not in children
    assert api_pid is None or api_pid in children.values()
    assert not genai_spans(receiver.traces().get(lost.trace_id, []))
    log = server.log_path.read_text(errors="replace")
    assert log.count("the telemetry export process is gone") == 1


def _exited(pid: int) -> bool:
    try:  # a zombie has closed its files; its parent, the API server, reaps it later
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

"""RequestTelemetry: vLLM request states -> spans and metrics (driven with stand-in states)."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from otel_llm import semconv
from otel_llm.config import Settings
from otel_llm.vllm.attribution import LabelGuard
from otel_llm.vllm.request_telemetry import RequestInfo, RequestTelemetry, start_request
from otel_llm.vllm.sink import InProcessSink
from otel_llm.vllm.telemetry import Telemetry


@pytest.fixture
def env(memory_otel):
    meter = memory_otel.meter_provider.get_meter("test")
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("test"), meter), meter, Settings(label_limit=2)
    )
    return SimpleNamespace(tel=tel, exporter=memory_otel.spans, reader=memory_otel.reader)


def stats(queued_ago=0.30, queue=0.05, prefill=0.10, decode=0.10, tokens=5, preemptions=0):
    now = time.monotonic()
    q0 = now - queued_ago
    return SimpleNamespace(
        queued_ts=q0,
        scheduled_ts=q0 + queue,
        first_token_ts=q0 + queue + prefill,
        last_token_ts=q0 + queue + prefill + decode,
        first_token_latency=queue + prefill + 0.01,
        num_generation_tokens=tokens,
        num_preemptions=preemptions,
    )


def state(request_id="r1", prompt_len=10, output_tokens=5, cached=0, st=None, parent=None, index=0):
    return SimpleNamespace(
        request_id=request_id,
        external_req_id="chatcmpl-" + request_id,
        prompt_len=prompt_len,
        num_cached_tokens=cached,
        detokenizer=SimpleNamespace(num_output_tokens=lambda: output_tokens),
        stats=st,
        parent_req=parent,
        request_index=index,
    )


def spans_by_name(exporter):
    return {s.name: s for s in exporter.get_finished_spans()}


def metric_points(reader, name):
    data = reader.get_metrics_data()
    return [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


def test_phases_are_children_in_order_with_engine_durations(env):
    record = start_request(env.tel, RequestInfo(operation="chat", model="m", temperature=0.0, tenant="acme"))
    time.sleep(0.001)
    st = stats(queued_ago=0.0005)  # engine timestamps right after the span started
    record.attach_engine_request(state(st=st))
    record.on_engine_finished(record.engine_states[0], "stop")
    time.sleep(0.26)
    record.end()
    spans = spans_by_name(env.exporter)
    genai = spans["chat m"]
    assert genai.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert genai.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 10
    assert genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert genai.attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 0
    assert genai.attributes[semconv.TENANT_ID] == "acme"
    assert genai.attributes[semconv.VLLM_TPOT_SECONDS] == pytest.approx(0.10 / 4)
    kids = [spans[n] for n in semconv.PHASE_SPANS]
    expected = (0.05, 0.10, 0.10)
    previous = genai.start_time
    for kid, seconds in zip(kids, expected):
        assert kid.parent.span_id == genai.context.span_id
        assert previous <= kid.start_time <= kid.end_time <= genai.end_time
        assert (kid.end_time - kid.start_time) / 1e9 == pytest.approx(seconds, abs=2e-6)
        previous = kid.end_time


def test_phases_are_clamped_inside_the_span(env):
    """Engine timestamps before the span began (clock skew) never put children outside it."""
    record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    record.attach_engine_request(state(st=stats(queued_ago=5.0)))
    record.end()
    spans = spans_by_name(env.exporter)
    genai = spans["chat m"]
    for name in semconv.PHASE_SPANS:
        assert genai.start_time <= spans[name].start_time <= spans[name].end_time <= genai.end_time


def test_parallel_sampling_counts_the_prompt_once(env):
    record = start_request(env.tel, RequestInfo(operation="chat", model="m", choice_count=2))
    parent = SimpleNamespace(request_id="parent")
    for i in range(2):
        record.attach_engine_request(
            state(
                f"c{i}", prompt_len=7, output_tokens=3 + i, cached=4, parent=parent, st=stats(queued_ago=0.0), index=i
            )
        )
    for st in record.engine_states:
        record.on_engine_finished(st, "length")
    record.end()
    genai = spans_by_name(env.exporter)["chat m"]
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 7
    assert genai.attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 4
    assert genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
    assert genai.attributes[semconv.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    assert genai.attributes[semconv.VLLM_ENGINE_REQUESTS] == 2
    assert semconv.VLLM_TPOT_SECONDS not in genai.attributes


def test_abort_marks_span_and_meters_generated_tokens(env):
    record = start_request(env.tel, RequestInfo(operation="chat", model="m", stream=True, tenant="t1"))
    record.attach_engine_request(state(output_tokens=3, st=stats(queued_ago=0.0)))
    record.end(aborted=True)
    record.end()  # idempotent
    spans = [s for s in env.exporter.get_finished_spans() if s.name == "chat m"]
    assert len(spans) == 1
    attrs = spans[0].attributes
    assert attrs[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED
    assert attrs[semconv.VLLM_ABORTED] is True
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == (semconv.FINISH_REASON_ABORT,)
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert spans[0].status.status_code.name == "ERROR"
    outputs = [
        p
        for p in metric_points(env.reader, semconv.SERVER_TOKEN_USAGE)
        if p.attributes[semconv.GEN_AI_TOKEN_TYPE] == semconv.TOKEN_TYPE_OUTPUT
    ]
    assert [p.value for p in outputs] == [3]
    (duration,) = metric_points(env.reader, semconv.SERVER_REQUEST_DURATION)
    assert duration.attributes[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED
    # no TTFT/TPOT for failed requests (semconv: successful responses only)
    assert metric_points(env.reader, semconv.SERVER_TIME_TO_FIRST_TOKEN) == []


def test_without_stats_no_phases_and_a_marker(env):
    record = start_request(env.tel, RequestInfo(operation="text_completion", model="m"))
    record.attach_engine_request(state(st=None))
    record.end()
    spans = spans_by_name(env.exporter)
    assert set(spans) == {"text_completion m"}
    assert spans["text_completion m"].attributes[semconv.VLLM_PHASE_TIMING_UNAVAILABLE] is True


def test_tenant_label_cap_on_metrics_full_value_on_spans(env):
    for tenant in ("a", "b", "c"):
        record = start_request(env.tel, RequestInfo(operation="chat", model="m", tenant=tenant))
        record.attach_engine_request(state(request_id=tenant, st=stats(queued_ago=0.0)))
        record.end()
    assert {s.attributes[semconv.TENANT_ID] for s in env.exporter.get_finished_spans() if s.name == "chat m"} == {
        "a",
        "b",
        "c",
    }
    labels = {p.attributes.get(semconv.TENANT_ID) for p in metric_points(env.reader, semconv.SERVER_REQUEST_DURATION)}
    assert labels == {"a", "b", semconv.LABEL_OTHER}


def test_broken_state_never_raises_and_span_still_ends(env):
    record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    bad = state(st=stats(queued_ago=0.0))
    bad.detokenizer = SimpleNamespace(num_output_tokens=lambda: 1 / 0)
    record.attach_engine_request(bad)
    record.end()
    assert [s.name for s in env.exporter.get_finished_spans()] == ["chat m"]
    assert env.tel.engine_requests_in_flight() == 0


def test_engine_owned_record_ends_when_all_engine_requests_finish(env):
    record = start_request(env.tel, RequestInfo(operation="text_completion", model="m"), engine_owned=True)
    st = state(st=stats(queued_ago=0.0))
    record.attach_engine_request(st)
    assert env.exporter.get_finished_spans() == ()
    record.on_engine_finished(st, "length")
    assert [s.name for s in env.exporter.get_finished_spans() if s.name.startswith("text")] == ["text_completion m"]


def test_a_stream_handed_to_its_engine_requests_ends_when_they_finish_or_abort(env):
    """RequestTelemetry.end_with_engines (a stream's record after its first chunk): it ends when every
    engine request finished, before the stream's own end; aborted when vLLM aborts one. Not where it has
    no engine request, or one already finished (the stream's end ends it then)."""

    def genai_spans():
        return [s for s in env.exporter.get_finished_spans() if s.name.startswith("chat")]

    record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    assert not record.end_with_engines()  # (no engine request yet)
    first, second = state("r1", st=stats(queued_ago=0.0)), state("r2", st=stats(queued_ago=0.0))
    record.attach_engine_request(first)
    record.attach_engine_request(second)
    assert record.end_with_engines() and not record.end_with_engines()  # (once)
    record.on_engine_finished(first, "stop")
    assert genai_spans() == []
    record.on_engine_finished(second, "length")
    (span,) = genai_spans()
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "length")
    assert span.attributes.get(semconv.VLLM_ABORTED) is None

    aborted = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    aborted.attach_engine_request(state("r3", st=stats(queued_ago=0.0)))
    assert aborted.end_with_engines()
    aborted.on_engine_aborted()
    assert aborted.ended and genai_spans()[-1].attributes[semconv.VLLM_ABORTED] is True

    finished = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    early = state("r4", st=stats(queued_ago=0.0))
    finished.attach_engine_request(early)
    finished.on_engine_finished(early, "length")  # (a one-token stream: finished by its first chunk)
    assert not finished.end_with_engines() and not finished.ended


@pytest.mark.parametrize("raised", [None, asyncio.CancelledError])
def test_a_route_ends_a_stream_whose_engine_end_never_came(env, raised):
    """A handler-hooked route (routes.py) whose stream was handed to its engine requests
    (end_with_engines) and whose engine end never came (a fault in the finish hook) ends it when the
    response is done: as finished, or for the exception that stopped it (a client gone: aborted)."""
    from otel_llm.vllm import routes

    records = []

    async def inner(scope, receive, send):
        record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
        routes.claim(record)
        record.attach_engine_request(state("r1", st=stats(queued_ago=0.0)))
        assert record.end_with_engines()
        records.append(record)
        if raised is not None:
            raise raised()

    app = routes._route_app(inner, routes.ROUTES["/v1/chat/completions"], env.tel)
    if raised is None:
        asyncio.run(app({"type": "http"}, None, None))
    else:
        with pytest.raises(raised):
            asyncio.run(app({"type": "http"}, None, None))
    (record,) = records
    span = spans_by_name(env.exporter)["chat m"]
    assert record.ended and span.attributes.get(semconv.VLLM_ABORTED) is (None if raised is None else True)


_START = {"type": "http.response.start", "status": 200}
_DONE = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True}
_LAST = {"type": "http.response.body", "body": b"", "more_body": False}


def _chunk(i):
    return {"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True}


@pytest.fixture(params=["route", "server span"])
def through(request):
    """Where a stream's messages are watched: the route's own send (`RouteScope.forward`), or the HTTP
    server span's send on the export process's replayed path (export/http.py `ServerSpan.sending`)."""
    return request.param


def _serve_stream(env, messages, *, engine=True, engine_finishes_at=None, raised=None, through="route"):
    """A handler-hooked route serving a stream the way vLLM's chat route does, its record handed to the
    route (routes.take_stream): `messages` through the route's send, the engine request finished just
    before message `engine_finishes_at`, then `raised` from the app, if any. Returns the record, what
    reached the server's send (with whether the record had ended by then), take_stream's answer and
    what the route handed each message to (its scope's `sender`), or, through a server span, that span's
    watch at each message and the span."""
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider

    from otel_llm.sdk import current
    from otel_llm.vllm import routes
    from otel_llm.vllm.export import deferred
    from otel_llm.vllm.export.http import ServerSpan

    out, records, answers, scopes = [], [], [], []

    async def send(message):
        out.append((message, records[0].ended))

    server_span = None
    if through == "server span":
        server_span = deferred.DeferredTracer(TracerProvider()).start_span("POST", _type=ServerSpan)
        server_span.response = server_span.watch = None
        server_span.send, send = send, server_span.sending

    async def inner(scope, receive, route_send):
        record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
        records.append(record)
        routes.claim(record)
        answers.append(routes.take_stream(record))
        engine_state = state("r1", st=stats(queued_ago=0.0))
        for i, message in enumerate(messages):
            if i == 1 and engine:  # (vLLM adds its engine request on the stream's first step)
                record.attach_engine_request(engine_state)
            if i == engine_finishes_at:
                record.on_engine_finished(engine_state, "length")
            scopes.append(routes.SCOPE.get().sender if server_span is None else server_span.watch)
            await route_send(message)
        if raised is not None:
            raise raised
        if server_span is not None:  # (no send of the route's own between the app and the server span's)
            assert route_send == server_span.sending

    app = routes._route_app(inner, routes.ROUTES["/v1/chat/completions"], env.tel)
    token = current.attach(Context({current.SPAN_KEY: server_span})) if server_span is not None else None
    try:
        asyncio.run(app({"type": "http"}, None, send))
    except BaseException as exc:  # noqa: BLE001
        assert exc is raised
    finally:
        if token is not None:
            current.detach(token)
    if server_span is not None:
        assert server_span.watch is None  # (nothing of the route's left on the span)
        return records[0], out, answers[0], (scopes, server_span)
    return records[0], out, answers[0], scopes


def test_a_stream_handed_to_its_route_is_timed_and_ends_with_its_engine_request(env, through):
    """The route's send, or the HTTP server span's, watches the stream until its first chunk: timed, then
    the record is its engine request's to end (before the last chunks go out); every message reaches the
    server unchanged."""
    from otel_llm.vllm.routes import RouteScope

    messages = [_START, _chunk(0), _chunk(1), _chunk(2), _DONE, _LAST]
    record, out, taken, senders = _serve_stream(env, messages, engine_finishes_at=3, through=through)
    assert taken and record.engine_owned
    assert [m for m, _ in out] == messages
    assert [ended for _, ended in out] == [False, False, False, True, True, True]
    # our watch until the first chunk; from then on each message goes to the server's send itself
    if through == "route":
        assert all(getattr(s, "__func__", None) is RouteScope.watching for s in senders[:2])
        assert len(set(senders[2:])) == 1 and getattr(senders[2], "__self__", None) is None
    else:
        watches, server_span = senders
        assert all(getattr(w, "__func__", None) is RouteScope.watch for w in watches[:2])
        assert watches[2:] == [None] * 4
        # the server span's own part: the response start kept, the span ended once the last body went out
        assert server_span.response == (_START, server_span._status) and server_span._ended
    span = spans_by_name(env.exporter)["chat m"]
    ttft = span.attributes[semconv.VLLM_STREAM_TTFT_SECONDS]
    assert 0 < ttft <= (span.end_time - span.start_time) / 1e9
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert semconv.VLLM_ABORTED not in span.attributes


@pytest.mark.parametrize("last", [_DONE, _LAST])
def test_a_stream_its_engine_cannot_end_ends_before_its_last_chunk(env, last, through):
    """No engine request by the first chunk (or one finished by then): the record ends at the [DONE]
    chunk, or the last one, before it goes out."""
    for engine, finishes in ((False, None), (True, 1)):
        env.exporter.clear()
        messages = [_START, _chunk(0), _chunk(1), last] + ([_LAST] if last is _DONE else [])
        record, out, _, _ = _serve_stream(env, messages, engine=engine, engine_finishes_at=finishes, through=through)
        assert not record.engine_owned
        assert [ended for _, ended in out] == [False, False, False, True] + ([True] if last is _DONE else [])
        span = spans_by_name(env.exporter)["chat m"]
        assert semconv.VLLM_STREAM_TTFT_SECONDS in span.attributes
        assert semconv.VLLM_ABORTED not in span.attributes


def test_a_stream_cut_before_its_last_chunk_is_an_abort_and_an_error_is_an_error(env, through):
    from starlette.requests import ClientDisconnect

    for raised in (None, ClientDisconnect(), asyncio.CancelledError()):  # the client left
        env.exporter.clear()
        _serve_stream(env, [_START, _chunk(0), _chunk(1)], engine=False, raised=raised, through=through)
        assert spans_by_name(env.exporter)["chat m"].attributes[semconv.VLLM_ABORTED] is True, raised
    env.exporter.clear()
    _serve_stream(env, [_START, _chunk(0)], engine=False, raised=ValueError("boom"), through=through)
    span = spans_by_name(env.exporter)["chat m"]
    assert span.attributes[semconv.ERROR_TYPE] == "ValueError"


def test_a_fault_in_the_routes_watch_leaves_the_stream_to_its_route(env, monkeypatch, through):
    """Our watch failing at the first chunk (after timing it): every message still goes out, watched no
    more, and the route ends the record when the response is done, as finished."""
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("ours")

    monkeypatch.setattr(RequestTelemetry, "end_with_engines", failing)
    messages = [_START, _chunk(0), _chunk(1), _DONE, _LAST]
    record, out, _, _ = _serve_stream(env, messages, engine=False, through=through)
    assert [m for m, _ in out] == messages and len(calls) == 1
    assert [ended for _, ended in out] == [False] * 5 and record.ended
    span = spans_by_name(env.exporter)["chat m"]
    assert span.attributes[semconv.VLLM_STREAM_TTFT_SECONDS] > 0 and semconv.VLLM_ABORTED not in span.attributes


def test_a_message_the_watch_cannot_read_still_goes_out(env):
    """A message without a type (not ASGI): our watch fails on it, the message goes out unchanged, and
    the stream is watched no more (the route ends its record when the response is done). (Through the
    HTTP server span's send such a message fails as the maintained middleware's `otel_send` fails it.)"""
    odd = {"body": b"?"}
    messages = [_START, odd, _chunk(0), _DONE, _LAST]
    record, out, _, _ = _serve_stream(env, messages, engine=False)
    assert [m for m, _ in out] == messages and record.ended
    span = spans_by_name(env.exporter)["chat m"]
    assert semconv.VLLM_STREAM_TTFT_SECONDS not in span.attributes and semconv.VLLM_ABORTED not in span.attributes


def test_only_a_handler_hooked_route_takes_its_own_record_s_stream(env):
    from otel_llm.vllm import routes

    assert not routes.take_stream(start_request(env.tel, RequestInfo(operation="chat", model="m")))  # no route
    seen = []

    async def send(message):
        pass

    async def inner(scope, receive, send):
        record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
        routes.claim(record)
        other = start_request(env.tel, RequestInfo(operation="chat", model="m"))
        seen.append((routes.take_stream(other), routes.take_stream(record)))

    for path, expected in (("/v1/chat/completions", (False, True)), ("/pooling", (False, False))):
        seen.clear()
        asyncio.run(routes._route_app(inner, routes.ROUTES[path], env.tel)({"type": "http"}, None, send))
        assert seen == [expected], path


def test_failed_requests_cannot_blow_up_model_labels(env):
    for i in range(25):
        start_request(env.tel, RequestInfo(operation="chat", model=f"junk-{i}")).end(error_type="NotFoundError")
    models = {
        p.attributes.get(semconv.GEN_AI_REQUEST_MODEL)
        for p in metric_points(env.reader, semconv.SERVER_REQUEST_DURATION)
    }
    assert len(models) == 21 and semconv.LABEL_OTHER in models


def test_unsampled_request_makes_no_phase_spans_but_keeps_metrics(env):
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    calls = []
    tracer = env.tel.sink.tracer

    class CountingTracer:
        def start_span(self, *args, **kwargs):
            calls.append(args[0])
            return tracer.start_span(*args, **kwargs)

    env.tel.sink.tracer = CountingTracer()
    unsampled = SpanContext(trace_id=1, span_id=2, is_remote=True, trace_flags=TraceFlags(0))
    token = context.attach(trace.set_span_in_context(NonRecordingSpan(unsampled)))
    try:
        record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    finally:
        context.detach(token)
    record.attach_engine_request(state(st=stats(queued_ago=0.0)))
    record.end()
    assert not record.span.is_recording()
    assert env.exporter.get_finished_spans() == ()
    assert calls == ["chat m"]  # no work spent on phase spans nobody will see
    (duration,) = metric_points(env.reader, semconv.SERVER_REQUEST_DURATION)
    assert duration.count == 1


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("acme", "acme"),
        ("  acme  ", "acme"),
        ("租户-é".encode().decode("latin-1"), "租户-é"),  # UTF-8 bytes as the ASGI server hands them over
        ("café", "café"),  # latin-1 that is not UTF-8 stays as sent
        ("a" * 128, "a" * 128),
        ("a" * 129, None),  # too long: refused whole, never cut
        ("ac\x00me", None),
        ("ac\nme", None),
        ("ac\u200bme", None),  # a zero-width (format) character
        ("", None),
        ("   ", None),
    ],
)
def test_attribution_values_are_checked(raw, expected):
    from otel_llm.vllm.attribution import attribution_value

    assert attribution_value(raw, 128) == expected


def test_an_invalid_header_falls_back_to_baggage_and_warns_once(env, caplog):
    from opentelemetry import baggage as otel_baggage

    ctx = otel_baggage.set_baggage(semconv.TENANT_ID, "from-baggage")
    with caplog.at_level("WARNING", logger="otel_llm"):
        for _ in range(3):
            assert env.tel.attribution({"x-tenant-id": "x" * 16384}, ctx) == ("from-baggage", None, None)
    assert len([r for r in caplog.records if "was ignored" in r.message]) == 1


def test_with_an_api_key_map_only_the_tenants_it_names_get_metric_labels(tmp_path, memory_otel):
    import hashlib
    import json

    from otel_llm.vllm.attribution import LabelGuard

    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": [{"sha256": hashlib.sha256(b"sk-a").hexdigest(), "tenant": "acme", "scene": "support"}]})
    )
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("t"), memory_otel.meter_provider.get_meter("t")),
        memory_otel.meter_provider.get_meter("t"),
        Settings(api_keys_file=str(keys), label_limit=50),
    )
    # 60 made-up tenants from headers cannot take the slots: they are all "other"
    assert {tel.label_tenant(f"junk-{i}") for i in range(60)} == {semconv.LABEL_OTHER}
    assert tel.label_tenant("acme") == "acme" and tel.label_scene("support") == "support"
    assert tel.label_scene("made-up") == semconv.LABEL_OTHER
    assert tel.label_cost_center("cc-1") == semconv.LABEL_OTHER  # the map names no cost center
    # without a map: the first N; with an allow-list: only it
    first_n = LabelGuard(limit=2)
    assert [first_n(v) for v in ("a", "b", "c", "a")] == ["a", "b", semconv.LABEL_OTHER, "a"]
    listed = LabelGuard(allow_list=("x",), vouched=frozenset({"acme"}))
    assert (listed("x"), listed("acme")) == ("x", semconv.LABEL_OTHER)


def test_label_guard_allow_list_and_cap():
    assert LabelGuard(allow_list=("a",))("a") == "a"
    assert LabelGuard(allow_list=("a",))("b") == semconv.LABEL_OTHER
    guard = LabelGuard(limit=2)
    assert [guard(v) for v in ("x", "y", "z", "x", None)] == ["x", "y", semconv.LABEL_OTHER, "x", None]


# --- a failed request's text is redacted: vLLM's 404 echoes the model name, an exception the prompt ---

LEAKED_KEY = "sk-proj-" + "Q7r2Lx9Vt4Mz8Kp3Hw6Nc1Bd"


def exported_text(env) -> str:
    spans = [
        (s.name, dict(s.attributes), s.status.description, [dict(e.attributes) for e in s.events])
        for s in env.exporter.get_finished_spans()
    ]
    return repr(spans) + env.reader.get_metrics_data().to_json()


def test_a_key_sent_as_the_model_is_redacted_in_name_attributes_status_and_metrics(env):
    record = start_request(env.tel, RequestInfo(operation="chat", model=LEAKED_KEY))
    record.end(error_type="NotFoundError", error_message=f"The model `{LEAKED_KEY}` does not exist.")
    (span,) = env.exporter.get_finished_spans()
    assert span.name == "chat <SECRET>"
    assert span.attributes[semconv.GEN_AI_REQUEST_MODEL] == "<SECRET>"
    assert span.attributes[semconv.ERROR_TYPE] == "NotFoundError"
    assert span.status.description == "The model `<SECRET>` does not exist."
    (duration,) = metric_points(env.reader, semconv.SERVER_REQUEST_DURATION)
    assert duration.attributes[semconv.GEN_AI_REQUEST_MODEL] == "<SECRET>"
    assert LEAKED_KEY[-8:] not in exported_text(env)


def test_an_exceptions_message_is_redacted_before_it_is_cut(env):
    from otel_llm.vllm.request_telemetry import MAX_ERROR_TEXT, end_with_exception

    # the key straddles the cut: cutting first would leave a part no rule recognises
    message = "x" * (MAX_ERROR_TEXT - 12) + " " + LEAKED_KEY + " and more"
    record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    record.attach_engine_request(state(st=stats(queued_ago=0.0)))
    end_with_exception(record, ValueError(message))
    (span,) = [s for s in env.exporter.get_finished_spans() if s.name == "chat m"]
    assert span.attributes[semconv.ERROR_TYPE] == "ValueError"
    assert span.status.description == "x" * (MAX_ERROR_TEXT - 12) + " <SECRET> an…"
    assert LEAKED_KEY[-8:] not in exported_text(env)


def test_a_huge_error_text_is_read_within_a_bound():
    from otel_llm.vllm.request_telemetry import MAX_ERROR_SCAN, redacted_error

    started = time.perf_counter()
    out = redacted_error(("sk-" + "a-" * 40 + " ") * (10 * MAX_ERROR_SCAN))
    assert time.perf_counter() - started < 1.0 and len(out) <= 501
    # a key cut by the scan bound is dropped whole, not left half
    assert "sk-" not in redacted_error("y " * (MAX_ERROR_SCAN // 2 - 4) + LEAKED_KEY)[-40:]


def test_the_export_process_path_redacts_the_same(env):
    from opentelemetry.sdk.trace import TracerProvider

    from otel_llm.vllm.export import deferred

    env.tel.sink.tracer = deferred.DeferredTracer(TracerProvider())
    record = start_request(env.tel, RequestInfo(operation="chat", model=LEAKED_KEY))
    record.end(error_type="NotFoundError", error_message=f"The model `{LEAKED_KEY}` does not exist.")
    (sent,) = record.span.outbox.spans
    assert sent[0] == "chat <SECRET>"
    assert LEAKED_KEY[-8:] not in repr(sent) and "<SECRET>" in repr(sent[12])


def test_vllms_warnings_and_errors_are_redacted_before_any_handler_writes_them(env):
    """What vLLM logs on a 404 (`Error with model ...`) and an exception it logs with its traceback."""
    import io
    import logging

    from otel_llm.vllm import wrappers

    made = {}

    def init_logger(name):  # vLLM's, as the hook wraps it
        made[name] = logging.getLogger(name)
        return made[name]

    earlier = logging.getLogger("vllm.test_earlier_module")  # made before the hook was applied
    uvicorn = logging.getLogger("uvicorn.error")
    wrapper = wrappers.redacting_loggers(env.tel)
    logger = wrapper(init_logger, None, ("vllm.test_serving_module",), {})
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    saved = [(each, each.propagate, each.level) for each in (logger, earlier, uvicorn)]
    for each in (logger, earlier, uvicorn):
        each.addHandler(handler)
        each.propagate = False
        each.setLevel(logging.INFO)
    try:
        logger.error("Error with model %s", f"ErrorInfo(message='The model `{LEAKED_KEY}` does not exist.')")
        try:
            raise ValueError(f"bad prompt {LEAKED_KEY}")
        except ValueError:
            earlier.exception("Error in preprocessing prompt inputs")
        try:
            raise KeyError(f"tool {LEAKED_KEY}")
        except KeyError:
            uvicorn.exception("Exception in ASGI application\n")  # (as uvicorn logs one escaping the app)
        logger.info("routine %s", LEAKED_KEY)  # below WARNING: untouched, costs nothing
    finally:
        for each, propagate, level in saved:
            each.removeHandler(handler)
            each.propagate, each.level = propagate, level
        for each in list(logging.root.manager.loggerDict.values()):  # this process's loggers, as they were
            if isinstance(each, logging.Logger):
                each.removeFilter(wrappers._LOG_FILTER)
    text = out.getvalue()
    assert "ERROR Error with model ErrorInfo(message='The model `<SECRET>` does not exist.')" in text
    assert "ValueError: bad prompt <SECRET>" in text and "Traceback" in text
    assert "ERROR Exception in ASGI application" in text and "KeyError: 'tool <SECRET>'" in text
    assert text.count(LEAKED_KEY) == 1 and f"INFO routine {LEAKED_KEY}" in text


def test_a_fault_in_the_phase_timing_loses_only_the_phases(env, monkeypatch):
    """The build of a request's end (request_facts.py, the same code in the export process): a failing
    phase step costs the phase attributes and spans, not the span's tokens or the request's metrics."""
    from otel_llm.vllm import request_facts

    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(request_facts, "_phases", broken)
    rec = start_request(env.tel, RequestInfo(operation="chat", model="tiny"))
    rec.attach_engine_request(state(st=stats()))
    rec.end()
    spans = spans_by_name(env.exporter)
    assert set(spans) == {"chat tiny"}
    attrs = spans["chat tiny"].attributes
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 10 and attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert semconv.VLLM_DECODE_SECONDS not in attrs
    [point] = metric_points(env.reader, semconv.SERVER_REQUEST_DURATION)
    assert point.count == 1


def test_request_info_and_engine_request_take_each_value_into_its_own_field():
    """request_info and contract.read_engine_request build their dataclasses positionally (for speed):
    each value lands in the field of its name."""
    from otel_llm.vllm import contract
    from otel_llm.vllm.attribution import Caller
    from otel_llm.vllm.request_telemetry import request_info

    sent = {
        "model": "m",
        "stream": True,
        "n": 2,
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 3,
        "seed": 11,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "use_beam_search": True,
    }
    request = object()
    info = request_info(
        "chat",
        sent.get,
        caller=Caller("ten", "scn", "cc", "key", "usr"),
        api_type="responses",
        request=request,
        conversation_id="conv",
    )
    assert info == RequestInfo(
        operation="chat",
        model="m",
        stream=True,
        choice_count=2,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        tenant="ten",
        scene="scn",
        cost_center="cc",
        api_key_id="key",
        user="usr",
        conversation_id="conv",
        api_type="responses",
        beam_search=True,
    )
    assert info.request is request

    read = contract.read_engine_request(
        SimpleNamespace(
            **vars(state("r9", prompt_len=12, output_tokens=4, cached=8, st=stats(tokens=4, preemptions=1), index=1)),
            num_cache_creation_tokens=3,
            remote_prefill_cached_tokens=5,
            lora_name="lora",
        )
    )
    assert (read.request_id, read.external_id, read.prompt_id, read.index) == ("r9", "chatcmpl-r9", "r9", 1)
    assert (read.prompt_tokens, read.cached_tokens, read.cache_creation_tokens) == (12, 8, 3)
    assert (read.remote_cached_tokens, read.output_tokens, read.output_text, read.lora_name) == (5, 4, None, "lora")
    assert (read.engine_cost, read.spec_decode) == (None, None)
    assert (read.timing.generation_tokens, read.timing.preemptions) == (4, 1)
    assert read.timing.scheduled - read.timing.queued == pytest.approx(0.05)
    assert read.timing.last_token - read.timing.first_token == pytest.approx(0.10)
    assert read.timing.first_token_latency == pytest.approx(0.16)


def test_an_ended_record_holds_none_of_vllms_objects(env):
    """Once read at the end, vLLM's engine request states and response metadata are let go (vLLM frees
    them where it finishes the request; a record kept until the response is done would free them later,
    cold), and a hook of vLLM's after the end changes nothing."""
    import weakref

    class EngineState:  # (a weak reference tells when the last holder let it go)
        def __init__(self, ns):
            self.__dict__.update(vars(ns))

    record = start_request(env.tel, RequestInfo(operation="chat", model="m"))
    engine_state = EngineState(state("r1", st=stats(queued_ago=0.0)))
    alive = weakref.ref(engine_state)
    record.attach_engine_request(engine_state)
    record.metadata = SimpleNamespace(request_id="chatcmpl-1", final_usage_info=None)
    record.on_engine_finished(engine_state, "stop")
    record.end()
    assert record.engine_states == [] and record.metadata is None
    del engine_state
    assert alive() is None
    record.on_final_output(SimpleNamespace(request_id="r1"))  # (ended: nothing more)
    (span,) = [s for s in env.exporter.get_finished_spans() if s.name == "chat m"]
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5

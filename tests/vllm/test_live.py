"""Live counting (otel_llm/vllm/live.py): a long request's tokens count while it runs. Driven with
stand-in vLLM request states whose output grows, sweeps at chosen times, the real spool and the
real metric readers (in process, and through the real export process)."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from devkit.otlp_receiver import Receiver
from otel_llm import __version__, semconv
from otel_llm.billing import ledger
from otel_llm.config import Settings
from otel_llm.vllm.export import wire
from otel_llm.vllm.export.sink import ExportProcessSink
from otel_llm.vllm.request_telemetry import RequestInfo, start_request
from otel_llm.vllm.sink import InProcessSink
from otel_llm.vllm.telemetry import Telemetry

S = 1_000_000_000
INPUT, CACHED, OUTPUT = semconv.TOKEN_TYPE_INPUT, semconv.TOKEN_TYPE_CACHED_INPUT, semconv.TOKEN_TYPE_OUTPUT


class EngineState(SimpleNamespace):
    """A stand-in for vLLM's RequestState whose output grows (`generated`)."""

    def __init__(self, request_id="r1", prompt_len=10, cached=4):
        super().__init__(
            request_id=request_id,
            external_req_id="chatcmpl-" + request_id,
            prompt_len=prompt_len,
            num_cached_tokens=cached,
            stats=None,
            parent_req=None,
            request_index=0,
        )
        self.generated = 0
        self.detokenizer = SimpleNamespace(num_output_tokens=lambda: self.generated)


def settings(spool, interval=1.0) -> Settings:
    return Settings(usage_dir=str(spool), usage_fsync_interval_s=0, live_interval_s=interval)


@pytest.fixture
def env(memory_otel, tmp_path):
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("test"), memory_otel.meter_provider.get_meter("test")),
        memory_otel.meter_provider.get_meter("test"),
        settings(tmp_path),
        {semconv.SERVICE_INSTANCE_ID: "host:8000"},
    )
    return SimpleNamespace(tel=tel, reader=memory_otel.reader, spool=str(tmp_path))


def token_series(reader) -> dict[tuple, int]:
    """(response model, token type) -> the counter's value, as a reader collects it now."""
    data = reader.get_metrics_data()
    return {
        (p.attributes.get(semconv.GEN_AI_RESPONSE_MODEL), p.attributes[semconv.GEN_AI_TOKEN_TYPE]): p.value
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == semconv.SERVER_TOKEN_USAGE
        for p in m.data.data_points
    }


def assert_grew(before: dict, after: dict) -> None:
    """A counter never dips: every series seen before is there and not lower."""
    assert all(after.get(series, -1) >= value for series, value in before.items()), (before, after)


def kinds(spool) -> list:
    return [r.get(semconv.USAGE_KIND) for r in ledger.read_spool(spool, kinds=None)]


def progress_records(spool) -> list[dict]:
    return ledger.read_spool(spool, kinds=(semconv.USAGE_KIND_PROGRESS,))


def test_a_long_stream_counts_while_it_runs_and_its_bill_is_its_usage(env):
    info = RequestInfo(
        operation=semconv.OP_CHAT, model="m", stream=True, tenant="acme", scene="search", cost_center="cc-1"
    )
    record = start_request(env.tel, info)
    state = EngineState()
    record.attach_engine_request(state)
    t0 = record.start_ns
    state.generated = 3
    assert env.tel.live.sweep(t0 + S // 2) == 0  # younger than the interval: nothing yet
    assert token_series(env.reader) == {} and kinds(env.spool) == []

    state.generated = 7
    assert env.tel.live.sweep(t0 + 3 * S // 2) == 1
    seen = token_series(env.reader)
    assert seen == {("m", INPUT): 10, ("m", CACHED): 4, ("m", OUTPUT): 7}
    (progress,) = progress_records(env.spool)
    assert progress == {
        semconv.USAGE_KIND: semconv.USAGE_KIND_PROGRESS,
        semconv.USAGE_ID: "host:8000/r1",
        semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
        semconv.SERVICE_NAME: semconv.SERVICE_NAME_DEFAULT,
        semconv.SERVICE_INSTANCE_ID: "host:8000",
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.TENANT_ID: "acme",
        semconv.TENANT_SCENE: "search",
        semconv.TENANT_COST_CENTER: "cc-1",
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 10,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 4,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 7,
        semconv.USAGE_TIME: t0 + 3 * S // 2,
        semconv.USAGE_TRACE_ID: format(record.span.get_span_context().trace_id, "032x"),
        semconv.USAGE_SPAN_ID: format(record.span.get_span_context().span_id, "016x"),
    }

    assert env.tel.live.sweep(t0 + 5 * S // 2) == 0  # nothing generated since: no record, no increment
    assert len(progress_records(env.spool)) == 1
    state.generated = 20
    assert env.tel.live.sweep(t0 + 7 * S // 2) == 1
    later = token_series(env.reader)
    assert_grew(seen, later)
    assert later[("m", OUTPUT)] == 20 and later[("m", INPUT)] == 10  # cumulative, the prompt counted once
    assert [r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] for r in progress_records(env.spool)] == [7, 20]

    state.generated = 25
    record.end()
    final = token_series(env.reader)
    assert_grew(later, final)
    assert final == {("m", INPUT): 10, ("m", CACHED): 4, ("m", OUTPUT): 25}
    (bill,) = ledger.read_spool(env.spool)  # the bills: progress records are not among them
    assert bill[semconv.USAGE_ID] == progress[semconv.USAGE_ID]
    assert (
        bill[semconv.GEN_AI_USAGE_INPUT_TOKENS],
        bill[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS],
        bill[semconv.GEN_AI_USAGE_OUTPUT_TOKENS],
    ) == (10, 4, 25)
    assert kinds(env.spool) == [semconv.USAGE_KIND_PROGRESS, semconv.USAGE_KIND_PROGRESS, None]

    state.generated = 30  # (vLLM's state outliving the request): no progress after the bill
    assert env.tel.live.sweep(t0 + 9 * S // 2) == 0 and env.tel.live.in_flight() == 0
    assert len(kinds(env.spool)) == 3 and token_series(env.reader) == final


def test_an_aborted_stream_keeps_what_was_counted_and_adds_the_rest(env):
    """Aborted, the request's labels change (no response model): what was counted in flight stays in
    its series, the rest goes to the aborted one; no series dips and the sum is the bill."""
    record = start_request(env.tel, RequestInfo(operation=semconv.OP_CHAT, model="m", stream=True))
    state = EngineState(cached=0)
    record.attach_engine_request(state)
    state.generated = 30
    env.tel.live.sweep(record.start_ns + 2 * S)
    seen = token_series(env.reader)
    assert seen == {("m", INPUT): 10, ("m", CACHED): 0, ("m", OUTPUT): 30}
    state.generated = 35
    record.end(aborted=True)
    final = token_series(env.reader)
    assert_grew(seen, final)
    assert final[(None, OUTPUT)] == 5 and final[(None, INPUT)] == 0
    (bill,) = ledger.read_spool(env.spool)
    assert bill[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_ABORTED
    for field, token_type in semconv.USAGE_TOKEN_FIELDS:
        assert sum(v for (_, t), v in final.items() if t == token_type) == bill[field]


def test_short_requests_cost_no_sweep_and_several_choices_share_one_prompt(env):
    short = start_request(env.tel, RequestInfo(operation=semconv.OP_CHAT, model="m"))
    short.attach_engine_request(EngineState("short"))
    t0 = short.start_ns
    parent = SimpleNamespace(request_id="parent")
    long = start_request(
        env.tel, RequestInfo(operation=semconv.OP_CHAT, model="m", choice_count=2), start_ns=t0 - 10 * S
    )
    choices = [EngineState(f"c{i}", prompt_len=6, cached=0) for i in range(2)]
    for i, choice in enumerate(choices):
        choice.parent_req, choice.request_index, choice.generated = parent, i, 4 + i
        long.attach_engine_request(choice)
    assert env.tel.live.in_flight() == 2
    assert env.tel.live.sweep(t0 + S // 2) == 1  # only the long one
    (progress,) = progress_records(env.spool)
    assert progress[semconv.USAGE_ID] == "host:8000/parent"
    assert (progress[semconv.GEN_AI_USAGE_INPUT_TOKENS], progress[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]) == (6, 9)
    for record in (short, long):
        record.end()
    assert token_series(env.reader)[("m", INPUT)] == 10 + 6
    assert env.tel.live.in_flight() == 0


def test_a_request_ended_on_another_thread_gets_no_progress_after_its_bill(env):
    """The finalizer thread ends a collected stream: its end waits for a sweep in progress, and a
    sweep that comes after it writes nothing for it."""
    record = start_request(env.tel, RequestInfo(operation=semconv.OP_CHAT, model="m", stream=True))
    state = EngineState()
    record.attach_engine_request(state)
    state.generated = 5
    with env.tel.live.lock:  # a sweep in progress
        ender = threading.Thread(target=record.end, kwargs={"aborted": True})
        ender.start()
        ender.join(0.3)
        assert ender.is_alive() and not record.ended
        assert env.tel.live.sweep(record.start_ns + 2 * S) == 1
    ender.join(30)
    assert record.ended
    env.tel.live._records[record] = None  # as if the sweep had taken its list before the end
    state.generated = 9
    assert env.tel.live.sweep(record.start_ns + 4 * S) == 0
    assert kinds(env.spool) == [semconv.USAGE_KIND_PROGRESS, None]


def test_zero_turns_it_off(memory_otel, tmp_path):
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("test"), memory_otel.meter_provider.get_meter("test")),
        memory_otel.meter_provider.get_meter("test"),
        settings(tmp_path, interval=0),
    )
    record = start_request(tel, RequestInfo(operation=semconv.OP_CHAT, model="m"), start_ns=time.time_ns() - 60 * S)
    state = EngineState()
    record.attach_engine_request(state)
    state.generated = 5
    assert not tel.live.enabled and tel.live.in_flight() == 0 and tel.live.sweep() == 0
    record.end()
    assert kinds(str(tmp_path)) == [None]


def test_one_timer_on_the_event_loop_sweeps_while_requests_are_in_flight(memory_otel, tmp_path):
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("test"), memory_otel.meter_provider.get_meter("test")),
        memory_otel.meter_provider.get_meter("test"),
        settings(tmp_path, interval=0.05),
    )

    async def serve():
        records = []
        for i in range(3):
            record = start_request(tel, RequestInfo(operation=semconv.OP_CHAT, model="m", stream=True))
            state = EngineState(f"r{i}")
            record.attach_engine_request(state)
            state.generated = 2
            records.append(record)
        timer = tel.live._timer
        assert timer is not None  # one timer for all of them
        deadline = time.monotonic() + 30
        while len({r[semconv.USAGE_ID] for r in progress_records(str(tmp_path))}) < 3:
            assert time.monotonic() < deadline, "the timer never swept"
            await asyncio.sleep(0.05)
        for record in records:
            record.end()
        while tel.live._timer is not None:  # its next tick finds nothing in flight and stops
            assert time.monotonic() < deadline, "the timer never stopped"
            await asyncio.sleep(0.05)

    asyncio.run(serve())
    assert kinds(str(tmp_path))[-3:] == [None, None, None]


RESOURCE = Resource.create({"service.name": "vllm", "service.instance.id": "host:8000"})


def test_progress_reaches_the_export_process_and_the_total_is_the_usage(monkeypatch, tmp_path):
    """With the export process (the default under opentelemetry-instrument): a sweep sends one
    message of increments, the request's Measurement the rest."""
    with Receiver(grpc=False) as receiver:
        for name, value in {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
            "OTEL_LLM_SHUTDOWN_TIMEOUT": "5",
        }.items():
            monkeypatch.setenv(name, value)
        meter = MeterProvider().get_meter("test")
        plan = {"traces": True, "metrics": True, "usage_events": False, "resource": dict(RESOURCE.attributes)}
        sink = ExportProcessSink(TracerProvider(resource=RESOURCE), meter, {**plan, "schema_url": None}, __version__, 5)
        link = sink.channel
        tel = Telemetry(sink, meter, settings(tmp_path))
        assert tel.sink.metrics is None
        record = start_request(tel, RequestInfo(operation=semconv.OP_CHAT, model="m", stream=True, tenant="acme"))
        state = EngineState()
        record.attach_engine_request(state)
        state.generated = 7

        def tokens(rx):
            return {
                p.attributes[semconv.GEN_AI_TOKEN_TYPE]: p.value
                for p in rx.latest_metrics()
                if p.name == semconv.SERVER_TOKEN_USAGE and p.attributes.get(semconv.TENANT_ID) == "acme"
            }

        assert tel.live.sweep(record.start_ns + 2 * S) == 1
        assert receiver.wait_for(lambda rx: tokens(rx).get(OUTPUT) == 7, 30)
        assert tokens(receiver) == {INPUT: 10, CACHED: 4, OUTPUT: 7}
        state.generated = 12
        record.end()
        assert receiver.wait_for(lambda rx: tokens(rx).get(OUTPUT) == 12, 30)
        assert tokens(receiver) == {INPUT: 10, CACHED: 4, OUTPUT: 12}
        link.close()


def test_the_interval_setting():
    assert Settings.from_env({}).live_interval_s == 5.0
    assert Settings.from_env({"OTEL_LLM_LIVE_INTERVAL": "0.5"}).live_interval_s == 0.5
    assert Settings.from_env({"OTEL_LLM_LIVE_INTERVAL": "-1"}).live_interval_s == 5.0  # invalid: the default


def test_a_new_event_loop_gets_its_own_timer(memory_otel, tmp_path):
    """A loop closed while a request was in flight (its timer pending) does not keep the next
    loop's requests from being swept."""
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("test"), memory_otel.meter_provider.get_meter("test")),
        memory_otel.meter_provider.get_meter("test"),
        settings(tmp_path, interval=0.05),
        {semconv.SERVICE_INSTANCE_ID: "host:8000"},
    )

    async def attach(name):
        record = start_request(tel, RequestInfo(operation=semconv.OP_CHAT, model="m", stream=True))
        state = EngineState(name)
        state.generated = 1
        record.attach_engine_request(state)
        return record

    asyncio.run(attach("left-in-flight"))

    async def second():
        await attach("r2")
        deadline = time.monotonic() + 30
        while "host:8000/r2" not in {r[semconv.USAGE_ID] for r in progress_records(str(tmp_path))}:
            assert time.monotonic() < deadline, "the second loop's request was never swept"
            await asyncio.sleep(0.05)

    asyncio.run(second())


def test_a_label_of_a_str_subclass_still_travels_to_the_export_process():
    """marshal refuses a str subclass (an enum value): the increments are made plain, not lost."""
    import enum
    import marshal

    class Tenant(str, enum.Enum):
        ACME = "acme"

    message = (wire.PROGRESS, [((semconv.OP_CHAT, "m", "m", Tenant.ACME, None, None), (10, 4, 7))])
    with pytest.raises(ValueError):
        marshal.dumps(message)
    assert marshal.loads(marshal.dumps(wire.plain(message))) == (
        wire.PROGRESS,
        [((semconv.OP_CHAT, "m", "m", "acme", None, None), (10, 4, 7))],
    )

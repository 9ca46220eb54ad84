"""A request ends exactly once, with the same outcome, whatever the order in which vLLM's hooks fire:
its stats hook (`_update_stats_from_finished`, which newer vLLM releases call for aborted requests
too, with FinishReason.ABORT), its final output (`do_tracing`, where the engine's figures arrive) and
`abort_requests`. Driven on the installed vLLM's own OutputProcessor and RequestStates, through the
hook table's real wrappers; every permutation of each set of events."""

import itertools
import time

import pytest
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.metrics.stats import IterationStats

from otel_llm import semconv
from otel_llm.billing import ledger
from otel_llm.config import Settings
from otel_llm.vllm import contract, hooks
from otel_llm.vllm.request_telemetry import CURRENT, RequestInfo, start_request
from otel_llm.vllm.sink import InProcessSink
from otel_llm.vllm.telemetry import Telemetry

_OUTPUT_HOOKS = ("engine request added", "engine request finished", "engine request aborted", "native tracing")
COST = "1000,400,0,0,0,7"  # an engine_cost summary: compute ns, prefill ns, KV, hits, preempted, scheduled tokens


@pytest.fixture
def env(memory_otel, tmp_path):
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("test"), memory_otel.meter_provider.get_meter("test")),
        memory_otel.meter_provider.get_meter("test"),
        Settings(usage_dir=str(tmp_path)),
    )
    patcher = hooks.patcher(tel, tuple(h for h in hooks.HOOKS if h.name in _OUTPUT_HOOKS))
    patcher.install()
    assert patcher.missing == []
    yield tel, memory_otel.spans, tmp_path
    patcher.uninstall()


def start(tel, choices=1):
    """An engine-owned request (offline vllm.LLM's kind) with `choices` real engine requests."""
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    record = start_request(tel, RequestInfo(operation=semconv.OP_TEXT_COMPLETION, model="m"), engine_owned=True)
    token = CURRENT.set(record)
    try:
        for index in range(choices):
            processor.add_request(
                EngineCoreRequest(
                    request_id=f"r{index}",
                    prompt_token_ids=[1, 2, 3],
                    mm_features=None,
                    sampling_params=SamplingParams(max_tokens=4, detokenize=False),
                    pooling_params=None,
                    arrival_time=time.time(),
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=None,
                    external_req_id="client-id",
                    session_id="conv-1",
                ),
                prompt=None,
                request_index=index,
            )
    finally:
        CURRENT.reset(token)
    assert len(record.engine_states) == choices
    contract.enable_final_outputs(processor)  # as _attach does with a ledger on
    return processor, record


def fire(processor, event: str, request_id: str = "r0", state=None):
    """One of vLLM's calls, as process_outputs / abort_requests make it."""
    state = state or processor.request_states.get(request_id)
    if event == "finish":
        processor._update_stats_from_finished(state, FinishReason.STOP, IterationStats())
    elif event == "finish_abort":  # vLLM's change that records stats of aborted requests
        processor._update_stats_from_finished(state, FinishReason.ABORT, IterationStats())
    elif event == "final_output":
        output = EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[],
            finish_reason=FinishReason.STOP,
            trace_headers={contract.ENGINE_COST_HEADER: COST},
        )
        processor.do_tracing(output, state, IterationStats())
    elif event == "abort":
        processor.abort_requests([request_id], internal=True)


def bills(spool):
    return [r for r in ledger.read_spool(str(spool)) if r.get(semconv.USAGE_KIND) != semconv.USAGE_KIND_PROGRESS]


@pytest.mark.parametrize("order", list(itertools.permutations(["finish", "final_output"])), ids=str)
def test_a_finished_request_ends_once_with_the_engines_figures_in_either_order(env, order):
    tel, spans, spool = env
    processor, record = start(tel)
    state = processor.request_states["r0"]
    fire(processor, order[0], state=state)
    assert not record.ended  # it waits for the other one
    fire(processor, order[1], state=state)
    fire(processor, "abort")  # too late: vLLM already let the request go
    (span,) = spans.get_finished_spans()
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert semconv.VLLM_ABORTED not in span.attributes and semconv.ERROR_TYPE not in span.attributes
    assert span.attributes[semconv.COST_COMPUTE_NS] == 1000  # the final output's figures made it
    assert span.attributes[semconv.GEN_AI_CONVERSATION_ID] == "conv-1"
    (bill,) = bills(spool)
    assert bill[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_FINISHED
    assert tel.engine_requests_in_flight() == 0


ABORT_EVENTS = ["abort", "finish_abort", "final_output"]


@pytest.mark.parametrize(
    "order",
    [
        o
        for n in (1, 2, 3)
        for o in itertools.permutations(ABORT_EVENTS, n)
        if "final_output" not in o[:1] and o != ("final_output",)
    ],
    ids=str,
)
def test_an_aborted_request_ends_once_as_aborted_whatever_comes_first(env, order):
    tel, spans, spool = env
    processor, record = start(tel)
    state = processor.request_states["r0"]
    for event in order:
        fire(processor, event, state=state)
    (span,) = spans.get_finished_spans()
    assert span.attributes[semconv.VLLM_ABORTED] is True
    assert span.attributes[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == (semconv.FINISH_REASON_ABORT,)
    (bill,) = bills(spool)
    assert bill[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_ABORTED
    assert tel.engine_requests_in_flight() == 0


@pytest.mark.parametrize(
    "order",
    list(itertools.permutations([("finish", "r0"), ("final_output", "r0"), ("finish", "r1"), ("final_output", "r1")])),
    ids=str,
)
def test_two_choices_end_once_after_both_finished_and_both_final_outputs(env, order):
    tel, spans, spool = env
    processor, record = start(tel, choices=2)
    states = dict(processor.request_states)
    for event, request_id in order:
        assert not record.ended
        fire(processor, event, request_id, state=states[request_id])
    (span,) = spans.get_finished_spans()
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "stop")
    assert span.attributes[semconv.COST_COMPUTE_NS] == 2000
    assert len(bills(spool)) == 1


def test_an_abort_through_the_stats_hook_marks_a_served_request(env):
    """A request its handler ends (the OpenAI server): the hooks only tell it the engine aborted."""
    tel, spans, _ = env
    processor, record = start(tel)
    record.engine_owned = False
    fire(processor, "finish_abort")
    assert record.engine_aborted and not record.ended
    record.end(aborted=record.engine_aborted)
    (span,) = spans.get_finished_spans()
    assert span.attributes[semconv.VLLM_ABORTED] is True

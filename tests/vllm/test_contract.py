"""The hook table and field contract (otel_llm/vllm/contract.py) against vLLM's sources: the installed
vLLM, every release `make compat` unpacked into .cache/vllm-src/, and small made-up source trees
that show each check fails when it should."""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import pytest

from otel_llm import patching
from otel_llm.cli.doctor import doctor
from otel_llm.vllm import contract, hooks, wrappers

COMPAT_SOURCES = sorted((Path(__file__).resolve().parents[2] / ".cache" / "vllm-src").glob("*/vllm/_version.py"))


def failures(findings):
    return [f for f in findings if not f.ok and f.required]


def test_installed_vllm_offers_every_hook_and_field():
    findings = contract.check(contract.installed_root(), hooks.HOOKS)
    assert failures(findings) == []
    assert {f.name for f in findings if f.kind == "fields"} == {spec.cls for spec in contract.FIELDS}


@pytest.mark.parametrize("version_file", COMPAT_SOURCES, ids=lambda p: p.parent.parent.name)
def test_unpacked_release_offers_every_hook_and_field(version_file):
    assert failures(contract.check(version_file.parent.parent, hooks.HOOKS)) == []


def write(root: Path, module: str, text: str) -> None:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.parents:
        if parent == root:
            break
        (parent / "__init__.py").touch()
    path.write_text(textwrap.dedent(text))


FIELDS = (contract.Fields(("vllm.state",), "State", ("prompt_len", "stats", "tokens"), ("newer",)),)
HOOK = patching.Hook(
    "handler", ("vllm.new.serving", "vllm.old.serving"), "Serving.create", wrappers.native_tracing_off, "x"
)


def test_fields_are_found_in_annotations_self_assignments_methods_and_relative_bases(tmp_path):
    write(
        tmp_path,
        "vllm.base",
        """
        class Base:
            def __init__(self):
                self.stats = None
    """,
    )
    write(
        tmp_path,
        "vllm.state",
        """
        from .base import Base

        class State(Base):
            prompt_len: int = 0

            def tokens(self):
                return 0
    """,
    )
    (finding,) = contract.check(tmp_path, hooks=(), fields=FIELDS)
    assert finding.ok and "optional, absent: newer" in finding.detail


def test_a_missing_field_fails_naming_it(tmp_path):
    write(
        tmp_path,
        "vllm.state",
        """
        class State:
            def __init__(self):
                self.prompt_len = 0
                self.tokens = []
    """,
    )
    (finding,) = contract.check(tmp_path, hooks=(), fields=FIELDS)
    assert not finding.ok and finding.detail.endswith("lacks stats (optional, absent: newer)")


def test_hook_found_in_the_first_candidate_module_that_exists(tmp_path):
    write(
        tmp_path,
        "vllm.old.serving",
        """
        class Serving:
            async def create(self, request):
                pass
    """,
    )
    (finding,) = contract.check(tmp_path, hooks=(HOOK,), fields=())
    assert finding.ok and finding.detail == "vllm.old.serving.Serving.create"
    write(tmp_path, "vllm.new.serving", "class Serving:\n    pass\n")
    (finding,) = contract.check(tmp_path, hooks=(HOOK,), fields=())
    assert not finding.ok and finding.detail == "vllm.new.serving.Serving.create not found"


def test_an_alias_shim_is_followed_to_the_module_vllm_imports(tmp_path, monkeypatch):
    # the package move seen in vLLM's repository: the old path stays as a sys.modules alias
    write(
        tmp_path,
        "vllm.frontend.entrypoints.serving",
        """
        class Serving:
            async def create(self, request):
                pass
    """,
    )
    write(
        tmp_path,
        "vllm.entrypoints.serving",
        """
        import importlib
        import sys

        sys.modules[__name__] = importlib.import_module("vllm.frontend.entrypoints.serving")
    """,
    )
    old_only = patching.Hook(
        "handler", ("vllm.entrypoints.serving",), "Serving.create", wrappers.native_tracing_off, "x"
    )
    (finding,) = contract.check(tmp_path, hooks=(old_only,), fields=())
    assert not finding.ok and "is an alias of vllm.frontend.entrypoints.serving" in finding.detail
    # at instrument time the post-import hook goes to the module vLLM imports
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    assert hooks.locate(old_only) == "vllm.frontend.entrypoints.serving"


def test_doctor_checks_unpacked_sources_and_fails_loudly(tmp_path):
    write(tmp_path, "vllm.state", "class State:\n    pass\n")
    out = io.StringIO()
    assert doctor(out, source=str(tmp_path)) == 1
    text = out.getvalue()
    assert "[missing] OutputProcessor: class not found" in text and "required hook(s) or field(s) missing" in text


def test_doctor_on_the_installed_vllm_finds_everything():
    out = io.StringIO()
    assert doctor(out) == 0, out.getvalue()
    text = out.getvalue()
    assert "all required hooks and fields found" in text
    assert "[ok] RequestStateStats" in text and "vllm serve --grpc" in text
    for hook in hooks.HOOKS:
        assert f"[ok] {hook.name}" in text
    assert "otel_llm_vllm" in text


def test_what_the_readers_read_is_declared():
    """Each attribute read_engine_request reads from a RequestState (`state`), its stats (`stats`)
    and its detokenizer is in FIELDS, so doctor and `make compat` check it on every release."""
    import ast
    import inspect

    declared = {spec.cls: set(spec.required) | set(spec.optional) for spec in contract.FIELDS}
    objects = {
        "state": declared["RequestState"],
        "stats": declared["RequestStateStats"],
        "detokenizer": declared["IncrementalDetokenizer"] | declared["BaseIncrementalDetokenizer"],
        "parent": declared["ParentRequest"],
    }
    tree = ast.parse(textwrap.dedent(inspect.getsource(contract.read_engine_request)))
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in objects:
            read.add((node.value.id, node.attr))
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "getattr"
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in objects
            and isinstance(node.args[1], ast.Constant)  # (not our own stashed attribute, _STASHED_COST)
        ):
            read.add((node.args[0].id, node.args[1].value))
    assert len(read) > 15
    assert [(obj, attr) for obj, attr in sorted(read) if attr not in objects[obj]] == []


def test_the_reader_on_vllms_own_objects():
    """read_engine_request on RequestStates the installed vLLM's OutputProcessor builds itself (no
    engine needed): a renamed or retyped field fails here, where a hand-made copy would not."""
    import time

    from vllm import PoolingParams, SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor

    def engine_request(request_id, **params):
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=[1, 2, 3, 4, 5],
            mm_features=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id="client-id",
            **params,
        )

    decode_leg = engine_request(
        "r-generate",
        pooling_params=None,
        sampling_params=SamplingParams(
            max_tokens=3,
            detokenize=False,
            extra_args={"kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 4}},
        ),
    )
    pooling = engine_request("r-pool", sampling_params=None, pooling_params=PoolingParams(task="embed"))
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    processor.add_request(decode_leg, prompt=None)
    processor.add_request(pooling, prompt=None, request_index=1)
    added = contract.read_added_request(processor, decode_leg)
    assert added[0] == "r-generate" and added[1] is processor.request_states["r-generate"] and added[3] is None
    assert added[2]["do_remote_prefill"] is True  # (its kv_transfer_params)
    states = processor.request_states

    generated = contract.read_engine_request(states["r-generate"])
    assert (generated.request_id, generated.external_id, generated.prompt_id, generated.index) == (
        "r-generate",
        "client-id",
        "r-generate",
        0,
    )
    assert (generated.prompt_tokens, generated.cached_tokens, generated.remote_cached_tokens) == (5, 0, 4)
    assert generated.output_tokens == 0 and generated.lora_name is None
    assert generated.timing == contract.EngineTiming(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)

    pooled = contract.read_engine_request(states["r-pool"])
    assert pooled.index == 1 and pooled.prompt_tokens == 5
    assert pooled.output_tokens is None and pooled.output_text is None  # no detokenizer: no decode
    assert contract.read_added_request(processor, pooling)[1:] == (states["r-pool"], None, None)


def test_the_newer_per_request_readers_on_vllms_own_objects():
    """Speculative decoding, the session id and reasoning tokens, read from the installed vLLM's own
    classes filled the way vLLM fills them."""
    import time

    from vllm import SamplingParams
    from vllm.entrypoints.serve.engine.protocol import CompletionTokenUsageInfo, UsageInfo
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=3, detokenize=False),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id="client-id",
        session_id="conv-7",
    )
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    processor.add_request(request, prompt=None)
    _, state, _, session = contract.read_added_request(processor, request)
    assert session == "conv-7" and state is processor.request_states["r"]
    assert contract.read_engine_request(state).spec_decode is None  # no speculator
    metrics = RequestSpecDecodeMetrics.new(num_spec_tokens=3)
    for drafted, accepted in ((3, 3), (3, 1), (3, 0), (2, 2)):  # as the scheduler observes verify steps
        metrics.observe(drafted, accepted)
    state.spec_decode_metrics = metrics
    drafts, accepted, steps = contract.read_engine_request(state).spec_decode
    figures = metrics.to_dict()  # what vLLM puts in the response's metrics.speculative_decoding
    assert (
        (drafts, accepted, steps)
        == (figures["num_draft_tokens"], figures["num_accepted_draft_tokens"], figures["num_spec_steps"])
        == (11, 6, 4)
    )
    assert accepted / drafts == figures["draft_acceptance_rate"]
    assert 1 + accepted / steps == figures["mean_acceptance_length"]

    metadata = type("Metadata", (), {})()
    metadata.final_usage_info = UsageInfo(
        prompt_tokens=3, completion_tokens=9, completion_tokens_details=CompletionTokenUsageInfo(reasoning_tokens=5)
    )
    assert contract.read_answer(None, metadata) == (None, None, [], 5)  # a stream: no response object
    response = type(
        "Response",
        (),
        {
            "usage": UsageInfo(
                prompt_tokens=3,
                completion_tokens=9,
                completion_tokens_details=CompletionTokenUsageInfo(reasoning_tokens=7),
            )
        },
    )
    assert contract.read_answer(response, metadata)[3] == 7
    metadata.final_usage_info = UsageInfo(prompt_tokens=3, completion_tokens=9)  # no reasoning parser
    assert contract.read_answer(None, metadata)[3] is None


def test_the_serving_layer_readers_on_vllms_own_objects():
    """A handler's request, its response and the metadata on its HTTP request, read from the installed
    vLLM's own pydantic classes: the fields contract.FIELDS declares for them."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, user="u-1"
    )
    get = contract.request_fields(request)
    assert (get("model"), get("max_completion_tokens"), get("user"), get("no_such_field")) == ("m", 5, "u-1", None)
    # a field vLLM's model lacks, sent by the client: pydantic keeps it as an extra field
    extra = ChatCompletionRequest(model="m", messages=[], safety_identifier="hash-1")
    assert contract.request_fields(extra)("safety_identifier") == "hash-1"
    assert contract.request_fields(request)("safety_identifier") is None

    # an attribute of the class (a property) is still read; an object that is no pydantic model
    # answers from its own __getattr__
    class WithProperty(ChatCompletionRequest):
        @property
        def max_output_tokens(self):
            return 7

    assert contract.request_fields(WithProperty(model="m", messages=[]))("max_output_tokens") == 7

    class Dynamic:
        def __getattr__(self, name):
            return f"dynamic {name}"

    assert contract.request_fields(Dynamic())("anything") == "dynamic anything"
    assert contract.read_request_content(request)["messages"] == [{"role": "user", "content": "hi"}]
    assert contract.read_request_content(request)["input"] is None

    chat = ChatCompletionResponse(
        id="chatcmpl-1",
        model="served",
        choices=[
            ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="a")),
            ChatCompletionResponseChoice(index=1, message=ChatMessage(role="assistant"), finish_reason=None),
        ],
        usage=UsageInfo(),
    )
    assert contract.generation_response(chat) is chat and not contract.is_stream(chat)
    assert contract.read_answer(chat, None) == ("chatcmpl-1", "served", ["stop", "error"], None)
    completion = CompletionResponse(
        model="served", choices=[CompletionResponseChoice(index=0, text="a", finish_reason="length")], usage=UsageInfo()
    )
    assert contract.read_answer(completion, None)[1:3] == ("served", ["length"])
    assert contract.read_answer(None, None) == (None, None, [], None)
    assert contract.generation_response(SimpleNamespace(data=[])) is None  # embeddings: not read

    raw_request = SimpleNamespace(headers={"x": "1"}, state=SimpleNamespace(request_metadata="metadata"))
    assert contract.read_headers(raw_request) == {"x": "1"} and contract.read_headers(None) is None
    assert contract.read_response_metadata(raw_request) == ("metadata", None)
    assert contract.read_response_metadata(SimpleNamespace(state=SimpleNamespace())) == (None, None)
    assert contract.read_response_metadata(None) == (None, None)


def test_a_starlette_requests_headers_and_metadata_are_read_from_its_scope():
    """A handler's Starlette request: its headers are its ASGI scope's list (what Request.headers reads),
    and the metadata vLLM sets on `request.state` is in the scope's state dict, with its id."""
    from starlette.requests import Request
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

    headers = [(b"x-tenant-id", b"acme"), (b"x-tenant-id", b"second")]
    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers})
    assert contract.read_response_metadata(request) == (None, None)  # (no state yet: none made by reading)
    metadata = RequestResponseMetadata(request_id="chatcmpl-7")
    request.state.request_metadata = metadata  # as vLLM's handler sets it
    assert contract.read_response_metadata(request) == (metadata, "chatcmpl-7")
    raw = contract.read_headers(request)
    assert raw is headers and raw == request.headers.raw


def test_the_serving_layer_readers_make_pydantic_raise_nothing(monkeypatch):
    """Per request the readers ask vLLM's pydantic models for names they may lack (a response's
    `error`, `status_code`; a request's fields of other endpoints): pydantic's __getattr__ raises and
    catches an AttributeError for each. They read the models' dictionaries instead, with the answers
    getattr gives."""
    from types import SimpleNamespace

    from pydantic import BaseModel
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

    asked = []
    missing = BaseModel.__getattr__

    def spy(self, name):
        asked.append(name)
        return missing(self, name)

    monkeypatch.setattr(BaseModel, "__getattr__", spy)
    chat = ChatCompletionResponse(
        id="chatcmpl-1",
        model="served",
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="a"))],
        usage=UsageInfo(),
    )
    metadata = RequestResponseMetadata(request_id="chatcmpl-1")
    request = ChatCompletionRequest(model="m", messages=[])
    assert getattr(chat, "error", None) is None and asked == ["error"]  # (what getattr costs)
    asked.clear()
    assert contract.read_error(chat) is None
    assert contract.generation_response(chat) is chat
    assert contract.read_result(chat) == (None, False, chat)
    assert contract.read_answer(chat, metadata) == ("chatcmpl-1", "served", ["stop"], None)
    get = contract.request_fields(request)
    assert [get(name) for name in ("max_output_tokens", "use_beam_search", "safety_identifier")] == [None, False, None]
    assert asked == []
    error = ErrorResponse(error=ErrorInfo(message="no", type="NotFoundError", code=404))
    assert contract.read_error(error) == ("NotFoundError", "no")
    assert contract.read_error(SimpleNamespace(status_code=503)) == ("503", "")
    assert contract.read_error(None) is None and contract.read_answer(None, None)[1] is None
    assert asked == []


def test_a_rejected_requests_error_type():
    """vLLM's exception handler answers with its ErrorResponse as JSON: its error.type, else the status."""
    from types import SimpleNamespace

    rejected = SimpleNamespace(status_code=400, body=b'{"error": {"type": "BadRequestError", "code": 400}}')
    assert contract.read_rejection_type(rejected) == "BadRequestError"
    assert contract.read_rejection_type(SimpleNamespace(status_code=422, body=b"not json")) == "422"
    assert contract.read_rejection_type(None) == "400"


def test_the_dictionary_fast_path_answers_as_read_field_for_vllms_requests(memory_otel, monkeypatch):
    """vLLM's request classes take request_fields' fast path (their __dict__'s get), whose answers are
    read_field's for every name the request path asks; the request path asks no other name."""
    import importlib

    from otel_llm import semconv
    from otel_llm.config import Settings
    from otel_llm.vllm import wrappers
    from otel_llm.vllm.sink import InProcessSink
    from otel_llm.vllm.telemetry import Telemetry

    classes = {
        "chat_completion": ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
        "completion": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
        "responses": ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
        "embeddings": ("vllm.entrypoints.pooling.embed.protocol", "EmbeddingCompletionRequest"),
    }
    bodies = {
        "chat_completion": {"messages": [], "max_tokens": 3, "top_k": 2, "user": "u"},
        "completion": {"prompt": "hi", "n": 2, "seed": 1, "stream": True},
        "responses": {"input": "hi", "max_output_tokens": 4},
        "embeddings": {"input": "hi"},
    }
    for kind, (module, name) in classes.items():
        cls = getattr(importlib.import_module(module), name)
        request = cls(model="m", **bodies[kind])
        get = contract.request_fields(request)
        assert get == request.__dict__.get, kind
        assert [get(n) for n in contract.REQUEST_FIELD_NAMES] == [
            contract.read_field(request, n) for n in contract.REQUEST_FIELD_NAMES
        ], kind
        # with an extra field sent, the general path
        extra = cls(model="m", safety_identifier="s-1", **bodies[kind])
        assert contract.request_fields(extra)("safety_identifier") == "s-1", kind

    asked = []
    fast = contract.request_fields

    def spy(request):
        get = fast(request)

        def recording(name):
            asked.append(name)
            return get(name)

        return recording

    meter = memory_otel.meter_provider.get_meter("t")
    tel = Telemetry(InProcessSink(memory_otel.tracer_provider.get_tracer("t"), meter), meter, Settings())
    module, name = classes["chat_completion"]
    request = getattr(importlib.import_module(module), name)(model="m", messages=[])
    monkeypatch.setattr(contract, "request_fields", spy)
    info = wrappers._request_info(semconv.OP_CHAT, request, tel, None)
    assert info.model == "m" and asked and set(asked) <= set(contract.REQUEST_FIELD_NAMES)


def test_read_result_answers_as_read_error_is_stream_and_generation_response_do():
    """read_result's answer per class (a plain response, a stream) is what the three readers answer."""
    from types import SimpleNamespace

    from starlette.responses import Response
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

    def separately(result):
        return (
            contract.read_error(result),
            contract.is_stream(result),
            (contract.generation_response(result) if not contract.is_stream(result) else None),
        )

    async def stream():
        yield "data: [DONE]\n\n"

    chat = ChatCompletionResponse(
        id="c",
        model="m",
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="a"))],
        usage=UsageInfo(),
    )
    with_extra = ChatCompletionResponse.model_validate({**chat.model_dump(), "error": {"code": 1}})
    results = [
        chat,
        chat,  # (its class known now)
        with_extra,
        ErrorResponse(error=ErrorInfo(message="no", type="NotFoundError", code=404)),
        Response(status_code=503),
        Response(status_code=200),
        SimpleNamespace(data=[]),
        None,
    ]
    for result in results:
        assert contract.read_result(result) == separately(result), result
    for _ in range(2):
        generator = stream()
        assert contract.read_result(generator) == (None, True, None) == separately(generator)
        generator.aclose().close()

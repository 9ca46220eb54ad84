"""Opt-in content capture on the real vLLM CPU server: prompts and completions on the GenAI span in
the semconv shapes, redacted before export, cut to the size caps with a marker, and counted per
redaction rule; for chats, streams with n=2, an abandoned stream and a 404. (The servers of the
other e2e modules run without the opt-in: tests/e2e/test_server_e2e.py checks no content leaves.)"""

import json

import openai
import pytest
from helpers import Traceparent, abandon_stream, genai_spans, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import config, content, redaction, semconv

MAX_TEXT, MAX_TOTAL = 600, 1500
PII = (
    "I am jane.doe@example.com, card 4111 1111 1111 1111, phone +1 415 555 2671, "
    "ID 11010519491231002X, from 10.0.12.7; not a card: 4111 1111 1111 1112"
)
PII_REDACTED = (
    "I am <EMAIL>, card <PAYMENT_CARD>, phone <PHONE>, ID <NATIONAL_ID>, from <IP_ADDRESS>; "
    "not a card: 4111 1111 1111 1112"
)
REDACT = redaction.Redactor().redact


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "content",
        paced=True,
        extra_args=["--max-model-len", "4096"],
        env={
            config.ENV_CAPTURE_CONTENT: "span_only",
            config.ENV_CONTENT_MAX_TEXT_LENGTH: str(MAX_TEXT),
            config.ENV_CONTENT_MAX_LENGTH: str(MAX_TOTAL),
        },
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-content-test-key-0123456789", max_retries=0) as c:
        yield c


def genai_span(receiver, trace_id):
    return receiver.wait_for(lambda rx: genai_spans(rx.traces().get(trace_id, [])) or None)[0]


def messages_of(span, attribute):
    return json.loads(span.attributes[attribute])


def assistant(text, reason):
    return {"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": reason}


def test_chat_prompt_and_answer_redacted(client, receiver):
    tp = Traceparent()
    response = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=8,
        extra_headers=tp.headers(),
        messages=[{"role": "system", "content": "Write to ops@example.org"}, {"role": "user", "content": PII}],
    )
    span = genai_span(receiver, tp.trace_id)
    assert messages_of(span, semconv.GEN_AI_INPUT_MESSAGES) == [
        {"role": "system", "parts": [{"type": "text", "content": "Write to <EMAIL>"}]},
        {"role": "user", "parts": [{"type": "text", "content": PII_REDACTED}]},
    ]
    choice = response.choices[0]
    assert messages_of(span, semconv.GEN_AI_OUTPUT_MESSAGES) == [
        assistant(REDACT(choice.message.content), choice.finish_reason)
    ]
    exported = json.dumps(span.attributes)
    for secret in ("jane.doe", "4111 1111 1111 1111", "415 555", "11010519491231002X", "10.0.12.7", "sk-content"):
        assert secret not in exported


def test_streamed_choices_assembled_once_per_choice(client, receiver):
    tp = Traceparent()
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Tell the story of " + PII, max_tokens=12, n=2, stream=True, extra_headers=tp.headers()
    )
    texts, reasons = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.text or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    span = genai_span(receiver, tp.trace_id)
    assert messages_of(span, semconv.GEN_AI_INPUT_MESSAGES) == [
        {"role": "user", "parts": [{"type": "text", "content": "Tell the story of " + PII_REDACTED}]}
    ]
    assert messages_of(span, semconv.GEN_AI_OUTPUT_MESSAGES) == [
        assistant(REDACT(texts[i]), reasons[i]) for i in (0, 1)
    ]


def test_abandoned_stream_keeps_what_the_engine_generated(server, receiver):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "a long story for jane@example.com"}],
        "max_tokens": 1900,
        "ignore_eos": True,
    }
    *_, left = abandon_stream(server.url, "/v1/chat/completions", body, lambda: Traceparent().headers())
    span = genai_span(receiver, left.trace_id)
    assert span.attributes[semconv.VLLM_ABORTED] is True
    assert messages_of(span, semconv.GEN_AI_INPUT_MESSAGES) == [
        {"role": "user", "parts": [{"type": "text", "content": "a long story for <EMAIL>"}]}
    ]
    (output,) = messages_of(span, semconv.GEN_AI_OUTPUT_MESSAGES)
    assert output["finish_reason"] == semconv.FINISH_REASON_ABORT
    # the engine's text up to the abort: some, and less than the 1900 tokens asked for
    (part,) = output["parts"]
    assert 0 < len(part["content"]) <= MAX_TEXT + len(content.TRUNCATED.format(10**6))


def test_rejected_request_keeps_its_prompt_and_has_no_output(client, receiver):
    tp = Traceparent()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": PII}], extra_headers=tp.headers()
        )
    span = genai_span(receiver, tp.trace_id)
    assert messages_of(span, semconv.GEN_AI_INPUT_MESSAGES) == [
        {"role": "user", "parts": [{"type": "text", "content": PII_REDACTED}]}
    ]
    assert semconv.GEN_AI_OUTPUT_MESSAGES not in span.attributes


def test_texts_cut_to_the_caps_with_a_marker(client, receiver):
    tp = Traceparent()
    long_texts = [c * 700 for c in "abc"]  # 700 > MAX_TEXT each; 3 x 600 > MAX_TOTAL
    response = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=4,
        extra_headers=tp.headers(),
        messages=[{"role": "user", "content": t} for t in long_texts],
    )
    span = genai_span(receiver, tp.trace_id)
    got = [m["parts"][0]["content"] for m in messages_of(span, semconv.GEN_AI_INPUT_MESSAGES)]
    marker = content.TRUNCATED.format
    assert got == ["a" * 600 + marker(100), "b" * 600 + marker(100), "c" * 300 + marker(400)]
    # nothing left for the output: the marker alone says how long it was (not redacted: nothing of it is kept)
    answer = response.choices[0].message.content
    (output,) = messages_of(span, semconv.GEN_AI_OUTPUT_MESSAGES)
    assert output["parts"][0]["content"] == (marker(len(answer)) if answer else "")


def test_redactions_counted_by_rule(client, receiver):
    tp = Traceparent()
    client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=2,
        extra_headers=tp.headers(),
        messages=[{"role": "user", "content": "mail a@example.com and b@example.com"}],
    )
    genai_span(receiver, tp.trace_id)

    def email_count(rx):
        points = [
            p
            for batch in rx.metric_batches
            for p in batch
            if p.name == semconv.REDACTIONS and p.attributes.get(semconv.REDACTION_RULE) == semconv.REDACTION_RULE_EMAIL
        ]
        return points[-1].value if points else 0

    def replaced(rx):  # the <EMAIL> tokens in every captured message this server exported
        return sum(
            s.attributes.get(a, "").count("<EMAIL>")
            for s in rx.spans
            for a in (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES)
        )

    # at least this module's inputs: chat 2, stream 1, abandoned 1, rejected 1, this one 2
    counted = receiver.wait_for(
        lambda rx: email_count(rx) if email_count(rx) >= 7 and email_count(rx) == replaced(rx) else None
    )
    assert counted == replaced(receiver)


def test_no_unredacted_pattern_or_key_anywhere_exported_or_logged(server, client, receiver):
    """After this module's requests (PII in prompts, an API key on every request): nothing exported
    (any span attribute, any metric attribute) and nothing in the server's log holds them."""
    tp = Traceparent()
    client.chat.completions.create(
        model=MODEL_NAME, max_tokens=2, extra_headers=tp.headers(), messages=[{"role": "user", "content": PII}]
    )
    genai_span(receiver, tp.trace_id)
    pieces = (
        "jane.doe",
        "4111 1111 1111 1111",
        "+1 415 555 2671",
        "11010519491231002X",
        "10.0.12.7",
        "sk-content-test-key-0123456789",
    )
    exported = [json.dumps(s.attributes, ensure_ascii=False) for s in receiver.spans]
    exported += [json.dumps(p.attributes, ensure_ascii=False) for batch in receiver.metric_batches for p in batch]
    log = server.log_path.read_text(errors="replace")
    for piece in pieces:
        assert not [text for text in exported if piece in text], piece
        assert piece not in log, piece

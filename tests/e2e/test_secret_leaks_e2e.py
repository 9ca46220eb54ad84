"""No secret leaves the process by any path, on the real vLLM server and the real OpenAI client.

One `opentelemetry-instrument vllm serve` with content capture on, the usage spool and OTLP usage
events on, its Python log records exported over OTLP too, and the instrumented OpenAI client in this
process exporting to the same receiver. One prompt holds a random secret of every format of
content/secret_formats.py (FORMATS, and CONTEXTUAL's texts), in each of its EMBEDDINGS in turn, and
every look-alike of NEGATIVES. It goes through chat, chat stream, completions, completions stream,
the Responses API (and its instructions) and a chat with tools whose conversation carries keys in
the assistant's tool call arguments and the tool's answer. Keys also go where content capture does
not reach: the model name (vLLM's 404 echoes it; one call per format), the `user` field, stop
sequences, a URL query, the Authorization and x-api-key headers (the client's api_key among them),
a request field vLLM rejects (its 400 echoes it), and the errors of a small fake provider that echo
the key it was sent (a 401, and an error event mid-stream; vLLM cannot be made to do that).

Then every byte that left is searched for each secret's last 8 (random) characters: each OTLP
request body as the receiver got it (traces, metrics, logs), the usage spool, the server's output
(vLLM's own log lines apart: vLLM writes them, see the last test) and this process's log records.
Every look-alike is in the exported gen_ai.input.messages verbatim, and so is `<SECRET>`. A prompt of
the redactor's worst cases is served, and exported as the redactor makes it on both layers.
OTEL_LLM_LEAK_SEED=<seed> repeats a run's secrets.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import string
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from content.secret_formats import CONTEXTUAL, EMBEDDINGS, FORMATS, NEGATIVES, WORST_CASES
from helpers import genai_spans, start_server
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from devkit.tiny_model import MODEL_NAME
from otel_llm import config, redaction, semconv
from otel_llm.openai import OpenAIInstrumentor

SEED = int(os.environ.get("OTEL_LLM_LEAK_SEED") or secrets.randbits(32))
MARK = "LEAK-PROBE-PROMPT"
MAX_CONTENT = 1_000_000  # no captured text is cut: every look-alike must arrive whole


def _embedders() -> list:
    """EMBEDDINGS as functions key -> text (a dict or a list of functions or format strings)."""
    items = EMBEDDINGS.values() if isinstance(EMBEDDINGS, dict) else EMBEDDINGS
    return [e if callable(e) else (lambda key, f=e: f.replace("{key}", key).replace("{}", key)) for e in items]


# characters a probe may hold: they are stored as they are in every place searched (JSON escapes
# quotes, backslashes and control characters; a probe holding one would be found nowhere)
_PROBE_SAFE = frozenset(string.ascii_letters + string.digits + "-_.~+/=:;,!#$%&*@^()[]{}|<>?")
_PEM_END = re.compile(r"(?:\\n|\n)?-----END [A-Z ]+-----$")


def _probe(secret: str, others: list[str]) -> str | None:
    """What is searched for: the secret's last 8 characters, or where it ends in fixed text (a PEM's
    END line, a provider's suffix, a JSON-escaped newline), the last 8 of its random part: the last
    8 storable characters in a row that no other secret of its format holds. None if it has none
    (a password of 4 to 7 characters)."""
    text = _PEM_END.sub("", secret)
    for end in range(len(text), 7, -1):
        window = text[end - 8 : end]
        if _PROBE_SAFE.issuperset(window) and not any(window in other for other in others):
            return window
    return None


@dataclass
class Secrets:
    """Every secret this module sends, by format and where it went; what must not leave."""

    rng: random.Random
    probes: dict[str, str] = field(default_factory=dict)  # label -> the characters searched for

    def key(self, fmt: str, where: str) -> str:
        def make(rng):
            key = FORMATS[fmt](rng)
            return key, key

        return self._draw(f"{fmt} ({where})", make)

    def contextual(self, name: str, where: str) -> str:
        """A text whose secret only its context tells (`password=...`, `Authorization: Basic ...`)."""
        return self._draw(f"{name} ({where})", CONTEXTUAL[name])

    def _draw(self, label: str, make) -> str:
        """The text of a (text, secret) from `make` whose secret has a probe, noted under `label`. A
        secret too short for one (a 4-character password) is drawn again: short secrets are the
        property tests' (content/test_secret_properties.py); here a probe must be unique in MBs."""
        for _ in range(100):
            text, secret = make(self.rng)
            probe = _probe(secret, [make(self.rng)[1] for _ in range(3)])
            if probe is not None:
                self.probes[label] = probe
                return text
        raise AssertionError(f"{label}: no secret with 8 random characters in 100 draws")


def build_prompt(keys: Secrets) -> tuple[str, dict[str, str]]:
    embed = _embedders()
    lines = [MARK]
    for i, fmt in enumerate(FORMATS):
        lines.append(f"[{fmt}] {embed[i % len(embed)](keys.key(fmt, 'prompt'))}")
    for i, name in enumerate(CONTEXTUAL, len(FORMATS)):
        lines.append(f"[{name}] {embed[i % len(embed)](keys.contextual(name, 'prompt'))}")
    negatives = {name: make(keys.rng) for name, make in NEGATIVES.items()}
    lines += [f"[look-alike {name}] {text}" for name, text in negatives.items()]
    return "\n".join(lines) + "\n", negatives


WORST_PROMPT = "\n".join(WORST_CASES)


# --- the server, the client and the fake provider ------------------------------------------------


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory, spool):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "leaks",
        extra_args=["--max-model-len", "32768"],
        env={
            config.ENV_CAPTURE_CONTENT: "span_only",
            config.ENV_CONTENT_MAX_TEXT_LENGTH: str(MAX_CONTENT),
            config.ENV_CONTENT_MAX_LENGTH: str(MAX_CONTENT),
            "OTEL_LLM_USAGE_DIR": str(spool),
            "OTEL_LLM_USAGE_EVENTS": "true",
            "OTEL_LOGS_EXPORTER": "otlp",
            # every log record the server writes goes out over OTLP too, ours among them
            "OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED": "true",
            config.ENV_LOG_PROPAGATE: "1",
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
        },
    )
    yield srv
    srv.stop()


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def client_otel(receiver):
    """The OpenAI client instrumentation in this process, content capture on, exporting OTLP/HTTP to
    the receiver; this process's log records kept."""
    saved = {k: os.environ.get(k) for k in (config.ENV_CONTENT_MAX_TEXT_LENGTH, config.ENV_CONTENT_MAX_LENGTH)}
    os.environ.update({k: str(MAX_CONTENT) for k in saved})
    resource = Resource.create({"service.name": "leak-test-client"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(f"{receiver.endpoint}/v1/traces"), schedule_delay_millis=200)
    )
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(f"{receiver.endpoint}/v1/metrics"), export_interval_millis=1000
    )
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
    logs = _Logs()
    loggers = [logging.getLogger(), logging.getLogger("otel_llm")]
    OpenAIInstrumentor().instrument(
        tracer_provider=tracer_provider, meter_provider=meter_provider, capture_content=True, include_usage=True
    )
    for logger in loggers:
        logger.addHandler(logs)
    try:
        yield tracer_provider, meter_provider, logs
    finally:
        for logger in loggers:
            logger.removeHandler(logs)
        OpenAIInstrumentor().uninstrument()
        tracer_provider.shutdown()
        meter_provider.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FakeProvider:
    """An OpenAI-compatible endpoint that rejects every call with an error echoing the key it was
    sent (401; a stream: one chunk, then an error event). Only for what vLLM cannot be made to do."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                key = (self.headers.get("authorization") or "").partition(" ")[2]
                if body.get("stream"):
                    chunk = {
                        "id": "c1",
                        "object": "chat.completion.chunk",
                        "created": 1,
                        "model": body["model"],
                        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
                    }
                    error = {"error": {"message": f"upstream rejected the key {key} mid-stream", "type": "server"}}
                    reply = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\n".encode()
                    self._send(200, "text/event-stream", reply)
                else:
                    error = {
                        "error": {
                            "message": f"Incorrect API key provided: {key}.",
                            "type": "invalid_request_error",
                            "code": "invalid_api_key",
                        }
                    }
                    self._send(401, "application/json", json.dumps(error).encode())

            def _send(self, status, content_type, body):
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# --- the traffic -----------------------------------------------------------------------------------


@dataclass
class Traffic:
    keys: Secrets
    prompt: str
    negatives: dict[str, str]
    server_requests: int = 0  # requests that reached the server (one GenAI span each)
    errors: list[str] = field(default_factory=list)


def _openai_key(keys: Secrets, where: str) -> str:
    """A key of an OpenAI-like format where the path needs one (the model name, the api_key...)."""
    fmt = next((f for f in FORMATS if "openai" in f.lower()), next(iter(FORMATS)))
    return keys.key(fmt, where)


def _drain(stream) -> None:
    for _ in stream:
        pass


@pytest.fixture(scope="module")
def traffic(server, client_otel) -> Traffic:
    keys = Secrets(random.Random(SEED))
    prompt, negatives = build_prompt(keys)
    t = Traffic(keys, prompt, negatives)
    api_key = _openai_key(keys, "api_key / Authorization header")
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120) as client:
        chat = client.chat.completions
        user, system = {"role": "user", "content": prompt}, {"role": "system", "content": MARK + " be brief"}
        # content: chat, chat stream, completions, completions stream, Responses, tools
        chat.create(
            model=MODEL_NAME,
            messages=[system, user],
            max_tokens=3,
            user=_openai_key(keys, "user field"),
            stop=[_openai_key(keys, "stop sequence")],
        )
        _drain(chat.create(model=MODEL_NAME, messages=[user], max_tokens=3, stream=True))
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3)
        _drain(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, stream=True))
        t.server_requests += 4
        try:
            client.responses.create(
                model=MODEL_NAME,
                input=prompt,
                max_output_tokens=3,
                instructions="answer; the key is " + _openai_key(keys, "Responses instructions"),
            )
            _drain(client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=3, stream=True))
            t.server_requests += 2
        except openai.NotFoundError:
            t.errors.append("the server does not serve the Responses API")
        call = {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "lookup",
                "arguments": json.dumps({"api_key": _openai_key(keys, "tool call arguments"), "q": MARK}),
            },
        }
        tool = {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "looks things up",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        chat.create(
            model=MODEL_NAME,
            max_tokens=3,
            tools=[tool],
            tool_choice="none",
            messages=[
                user,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": "found " + _openai_key(keys, "tool message") + " for " + MARK,
                },
            ],
        )
        t.server_requests += 1
        # a key as the model name: vLLM's 404 echoes it (one per format; a stream and a completion too)
        for fmt in FORMATS:
            with pytest.raises(openai.NotFoundError):
                chat.create(model=keys.key(fmt, "model name"), messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.NotFoundError):
            chat.create(model=_openai_key(keys, "model name, stream"), messages=[user], stream=True)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=_openai_key(keys, "model name, completions"), prompt="hi")
        t.server_requests += len(FORMATS) + 2
        # the redactor's worst cases (their time per KB is bounded in content/test_redaction_time.py)
        chat.create(model=MODEL_NAME, messages=[{"role": "user", "content": WORST_PROMPT}], max_tokens=1)
        t.server_requests += 1
    # over plain HTTP: a key in the query, in headers, and in a field vLLM rejects (its 400 echoes it)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    headers = {
        "authorization": "Bearer " + _openai_key(keys, "raw Authorization header"),
        "x-api-key": _openai_key(keys, "x-api-key header"),
    }
    ok = httpx.post(
        f"{server.url}/v1/chat/completions?api_key={_openai_key(keys, 'URL query')}",
        json=body,
        headers=headers,
        timeout=120,
    )
    assert ok.status_code == 200, ok.text
    rejected = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**body, "max_tokens": _openai_key(keys, "rejected field")},
        timeout=120,
    )
    assert rejected.status_code == 400, rejected.text
    t.server_requests += 2
    # a provider whose errors echo the key it was sent (what vLLM cannot be made to do)
    fake = FakeProvider()
    try:
        with openai.OpenAI(base_url=fake.url, api_key=_openai_key(keys, "fake provider 401"), max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        with openai.OpenAI(base_url=fake.url, api_key=_openai_key(keys, "fake provider stream"), max_retries=0) as c:
            with pytest.raises(openai.APIError):
                _drain(
                    c.chat.completions.create(
                        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                )
    finally:
        fake.close()
    return t


@dataclass
class Exported:
    """Every byte that left: (where, bytes)."""

    places: list[tuple[str, bytes]]


@pytest.fixture(scope="module")
def exported(traffic, server, receiver, spool, client_otel) -> Exported:
    """After the traffic: the server's spans all arrived, then the server stopped (its exit flush sends
    the rest) and the client's providers flushed."""
    receiver.wait_for(
        lambda rx: (
            len([s for s in genai_spans(rx.spans) if s.scope == "otel_llm.vllm"]) >= traffic.server_requests or None
        ),
        timeout=60,
    )
    server.stop()
    tracer_provider, meter_provider, logs = client_otel
    tracer_provider.force_flush()
    meter_provider.force_flush()
    with receiver._lock:
        places = [(f"OTLP {signal} body #{i}", body) for i, (signal, body) in enumerate(receiver.bodies)]
    places += [(f"spool {p.name}", p.read_bytes()) for p in sorted(spool.iterdir())]
    lines = server.log_path.read_bytes().splitlines(keepends=True)
    vllms = [line for line in lines if VLLM_LOG_LINE.match(line)]
    places.append((VLLM_LOG, b"".join(vllms)))
    places.append(("server log, other lines", b"".join(line for line in lines if not VLLM_LOG_LINE.match(line))))
    places.append(("test process log records", "\n".join(logs.lines).encode()))
    return Exported(places)


VLLM_LOG = "server log, vLLM's own lines"
# vLLM's log format, on every line of a record (its NewLineFormatter):
# `(APIServer pid=7) ERROR 12-04 03:41:15 [serving.py:274] ...`
VLLM_LOG_LINE = re.compile(
    rb"^(?:\([\w-]+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    rb"\d\d-\d\d [\d:]{8} \[[^\]]+\] "
)


# --- the checks ------------------------------------------------------------------------------------


def test_the_probes_are_distinct_from_everything_else_sent(traffic):
    """(the search below is meaningful: no probe occurs in the look-alikes or the prompt's own words)"""
    others = traffic.prompt
    for label, probe in traffic.keys.probes.items():
        if "(prompt)" in label:
            others = others.replace(probe, "")
    for label, probe in traffic.keys.probes.items():
        assert probe not in others and not any(probe in n for n in traffic.negatives.values()), label


def _leaks(traffic, places) -> dict[str, list[str]]:
    """probe label -> where its characters were found."""
    leaks = {}
    for label, probe in traffic.keys.probes.items():
        needle = probe.encode()
        found = sorted({where.split(" #")[0] for where, data in places if needle in data})
        if found:
            leaks[label] = found
    return leaks


def _report(leaks: dict[str, list[str]]) -> str:
    formats = sorted({label.split(" (")[0] for label in leaks})
    return f"seed {SEED}: keys of {len(formats)} format(s) left the process: {formats}\n" + "\n".join(
        f"  {label}: {where}" for label, where in sorted(leaks.items())
    )


def test_no_key_leaves_in_telemetry_spool_or_logs(traffic, exported):
    """OTLP traces, metrics and logs (the server's log records, ours among them, and usage events), the
    usage spool, the server's output but vLLM's own log lines, this process's log records."""
    assert traffic.errors == []
    kinds = {where.split(" #")[0].split(" usage-")[0] for where, _ in exported.places}
    assert {"OTLP traces body", "OTLP metrics body", "OTLP logs body", "spool"} <= kinds, kinds
    # the search sees what was exported: the prompt's captured text is in the raw trace bodies
    assert any(MARK.encode() in data for where, data in exported.places if where.startswith("OTLP traces"))
    leaks = _leaks(traffic, [(where, data) for where, data in exported.places if where != VLLM_LOG])
    assert not leaks, _report(leaks)


def test_no_key_in_vllms_own_log_lines(traffic, exported):
    """vLLM logs what it rejects (`Error with model ErrorInfo(message='The model `...` does not exist')`
    on a chat or Responses 404) and the exceptions it catches: its loggers' warnings and errors pass
    otel-llm's RedactingLogFilter (otel_llm/vllm/wrappers.py, on every logger vLLM's init_logger makes)."""
    leaks = _leaks(traffic, [(where, data) for where, data in exported.places if where == VLLM_LOG])
    assert not leaks, _report(leaks)


def _captured_texts(span) -> str:
    """Every text of the span's gen_ai.input.messages (decoded: JSON escapes undone)."""
    texts = []

    def walk(value):
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(json.loads(span.attributes[semconv.GEN_AI_INPUT_MESSAGES]))
    return "\n".join(texts)


def test_look_alikes_arrive_verbatim_and_keys_as_secret_tokens(traffic, exported, receiver):
    spans = [s for s in receiver.spans if MARK in s.attributes.get(semconv.GEN_AI_INPUT_MESSAGES, "")]
    layers = {s.scope for s in spans}
    assert layers == {"otel_llm.vllm", "otel_llm.openai"}, layers
    # chat, stream, completions, stream, 2 Responses, tools, the raw chat on the server; most on the client
    assert len([s for s in spans if s.scope == "otel_llm.vllm"]) >= 8
    for span in spans:
        texts = _captured_texts(span)
        missing = [name for name, text in traffic.negatives.items() if text not in texts]
        assert not missing, f"seed {SEED}: look-alikes changed on {span.scope} {span.name}: {missing}"
        assert "<SECRET>" in texts


def test_a_prompt_of_worst_cases_is_served_and_exported_as_the_redactor_makes_it(traffic, exported, receiver):
    """The request of the redactor's worst cases was answered (the traffic went on) and both layers
    exported its text whole, as the built-in rules redact it (near misses all: verbatim), no part
    skipped or cut. (Their time is bounded per KB by CPU time in content/test_redaction_time.py, which a
    busy machine cannot fail; wall time here could: the engine's prefill shares the cores.)"""
    expected = redaction.Redactor().redact(WORST_PROMPT)
    layers = sorted(
        s.scope
        for s in receiver.spans
        if semconv.GEN_AI_INPUT_MESSAGES in s.attributes and expected in _captured_texts(s)
    )
    assert layers == ["otel_llm.openai", "otel_llm.vllm"], layers

"""`make demo`: the tiny model on CPU under `opentelemetry-instrument vllm serve`, a chat
request and a streaming completion, and each resulting trace printed as a tree."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from otel_llm import semconv
from otel_llm.devserver import VLLMServer, otlp_env
from otel_llm.otlp_receiver import Receiver
from otel_llm.trace_tree import render


def _client_tracer(endpoint: str):
    """A tracer of our own, so the demo's requests carry a traceparent like a real app's."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "demo-app"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint + "/v1/traces")))
    return provider.get_tracer("otel_llm.demo")


def _wait_for_trace(receiver: Receiver, trace_id: str, timeout: float = 15.0):
    def done(rx):
        spans = rx.traces().get(trace_id, [])
        servers = [s for s in spans if s.kind == "SERVER"]
        return spans if servers and any(s.name in semconv.PHASE_SPANS or s.status == "ERROR" for s in spans) else None

    try:
        return receiver.wait_for(done, timeout)
    except TimeoutError:
        return receiver.traces().get(trace_id, [])


def main() -> int:
    import openai
    from opentelemetry import propagate

    log = Path(tempfile.gettempdir()) / "otel-llm-demo-vllm.log"
    with Receiver() as receiver:
        print(f"OTLP receiver on {receiver.endpoint}; starting `opentelemetry-instrument vllm serve` "
              f"(tiny model, CPU; ~40 s; log: {log})", flush=True)
        server = VLLMServer(env=otlp_env(receiver.endpoint), log_path=log,
                            extra_args=["--enable-prompt-tokens-details"])
        started = time.monotonic()
        server.start()
        print(f"server ready in {time.monotonic() - started:.0f} s at {server.url}\n", flush=True)
        tracer = _client_tracer(receiver.endpoint)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="demo-key", max_retries=0)
        traces = []
        try:
            with tracer.start_as_current_span("demo chat request") as span:
                headers: dict[str, str] = {}
                propagate.inject(headers)
                reply = client.chat.completions.create(
                    model=server.served_model_name,
                    messages=[{"role": "user", "content": "How many tokens did this request use?"}],
                    max_tokens=16, temperature=0, extra_headers={**headers, "x-tenant-id": "acme"},
                )
                traces.append(("chat completion", format(span.get_span_context().trace_id, "032x"), reply.usage))
            with tracer.start_as_current_span("demo streaming request") as span:
                headers = {}
                propagate.inject(headers)
                stream = client.completions.create(
                    model=server.served_model_name, prompt="Queue, prefill and decode:", max_tokens=24,
                    stream=True, stream_options={"include_usage": True}, extra_headers=headers,
                    extra_body={"ignore_eos": True},
                )
                usage = [chunk.usage for chunk in stream][-1]
                traces.append(("streaming completion", format(span.get_span_context().trace_id, "032x"), usage))
            for title, trace_id, usage in traces:
                spans = _wait_for_trace(receiver, trace_id)
                print(f"== {title}: trace {trace_id}")
                print(f"   usage in the response: prompt={usage.prompt_tokens} completion={usage.completion_tokens}")
                print(render(spans))
                print()
        finally:
            server.stop()
    print("Point the exporter at a real collector, Jaeger or Tempo instead:\n"
          "  OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 opentelemetry-instrument vllm serve MODEL")
    return 0


if __name__ == "__main__":
    sys.exit(main())

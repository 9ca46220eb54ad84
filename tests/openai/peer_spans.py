"""Run one OpenAI instrumentation (ours or a peer's) against recorded exchanges; print its spans
as JSON. Used by test_openai_peer_compat.py in a subprocess, since instrumentations patch openai
globally:  python tests/openai/peer_spans.py MODULE [PEER_DIR]"""

import asyncio
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if len(sys.argv) > 2:
    sys.path.insert(0, sys.argv[2])
sys.path.insert(1, str(HERE))
sys.path.insert(2, str(HERE.parents[1]))  # the repository root

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

HELLO = [{"role": "user", "content": "Say this is a test"}]


def scenarios(client, aclient):
    yield (
        "chat",
        "test_chat_completion_extra_params.yaml",
        lambda: client.chat.completions.create(
            model="gpt-4o-mini",
            messages=HELLO,
            max_tokens=50,
            seed=42,
            temperature=0.5,
            response_format={"type": "text"},
            service_tier="default",
        ),
    )
    yield (
        "chat-404",
        "test_chat_completion_404.yaml",
        lambda: client.chat.completions.create(model="this-model-does-not-exist", messages=HELLO),
    )
    yield (
        "stream",
        "test_chat_completion_streaming.yaml",
        lambda: list(
            client.chat.completions.create(
                model="gpt-4", messages=HELLO, stream=True, stream_options={"include_usage": True}
            )
        ),
    )

    async def two_choices():
        return await aclient.chat.completions.create(model="gpt-4o-mini", messages=HELLO, n=2)

    yield "async-n2", "test_async_chat_completion_multiple_choices.yaml", lambda: asyncio.run(two_choices())
    yield (
        "embeddings",
        "test_embeddings_with_dimensions.yaml",
        lambda: client.embeddings.create(
            model="text-embedding-3-small", dimensions=512, input="This is a test for embeddings with dimensions"
        ),
    )
    yield (
        "responses",
        "test_responses_create_basic[content_mode0].yaml",
        lambda: client.responses.create(
            model="gpt-4o-mini", input="Say this is a test", instructions="You are a helpful assistant."
        ),
    )


def main() -> None:
    module = importlib.import_module(sys.argv[1])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    module.OpenAIInstrumentor().instrument(
        tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()])
    )
    import openai
    from openai_replay import ReplayServer

    result = {}
    with ReplayServer() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="sk-compat", max_retries=0)
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-compat", max_retries=0)
        for name, cassette, call in scenarios(client, aclient):
            server.reset()
            server.play(cassette)
            exporter.clear()
            try:
                call()
            except openai.APIError:
                pass
            result[name] = [
                {
                    "name": s.name,
                    "kind": s.kind.name,
                    "status": s.status.status_code.name,
                    "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.attributes.items()},
                }
                for s in exporter.get_finished_spans()
            ]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

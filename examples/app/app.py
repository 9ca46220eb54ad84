"""An app calling the gateway with the OpenAI Python client. No OpenTelemetry code of its own:

    OTEL_SERVICE_NAME=llm-app opentelemetry-instrument python examples/app/app.py all

Prints one JSON line per call: {"call", "response_id", "usage" (or null), "chunks"}.
"""

from __future__ import annotations

import json
import os
import sys

import openai

MESSAGES = [{"role": "user", "content": "In one sentence: what does a trace show?"}]


def chat(client: openai.OpenAI, model: str) -> dict:
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=32)
    return {"response_id": response.id, "usage": _usage(response.usage), "chunks": 0}


def stream(client: openai.OpenAI, model: str) -> dict:
    chunks, response_id, usage = 0, None, None
    with client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=32, stream=True, stream_options={"include_usage": True}
    ) as events:
        for chunk in events:
            chunks += 1
            response_id = response_id or chunk.id
            usage = chunk.usage or usage  # the last chunk carries it
    return {"response_id": response_id, "usage": _usage(usage), "chunks": chunks}


def stop_early(client: openai.OpenAI, model: str) -> dict:
    """Reads two chunks of a long answer, then closes the stream (the server should abort)."""
    chunks, response_id = 0, None
    events = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=256, stream=True)
    try:
        for chunk in events:
            chunks += 1
            response_id = response_id or chunk.id
            if chunks == 2:
                break
    finally:
        events.close()
    return {"response_id": response_id, "usage": None, "chunks": chunks}


def _usage(usage) -> dict | None:
    return usage.model_dump(exclude_none=True) if usage is not None else None


CALLS = {"chat": chat, "stream": stream, "stop-early": stop_early}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in (*CALLS, "all"):
        print(f"usage: app.py {{{'|'.join(CALLS)}|all}}", file=sys.stderr)
        return 2
    client = openai.OpenAI(
        base_url=os.environ.get("APP_BASE_URL", "http://127.0.0.1:8080/v1"), api_key=os.environ["APP_API_KEY"]
    )
    model = os.environ.get("APP_MODEL") or client.models.list().data[0].id
    names = list(CALLS) if argv[0] == "all" else argv
    for name in names:
        print(json.dumps({"call": name, **CALLS[name](client, model)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

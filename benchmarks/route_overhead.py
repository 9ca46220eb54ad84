"""What the route layer (otel_llm/vllm/routes.py) adds to a request on vLLM's ASGI routes, side by
side with the same route unwrapped, in one run: a handler-hooked route (chat, completions) must add a
constant per request and nothing per streamed chunk; a route without a handler hook reads its body and
status, one call per message.

    .venv/bin/python benchmarks/route_overhead.py
"""

from __future__ import annotations

import asyncio
import time

from otel_llm import semconv
from otel_llm.vllm import routes


def inner_app(chunks: int):
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200})
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def _send(message):
    pass


async def _receive():
    return {"type": "http.request", "body": b'{"model": "m"}', "more_body": False}


async def _per_request_us(app, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        await app({"type": "http", "headers": []}, _receive, _send)
    return (time.perf_counter() - start) / n * 1e6


def best_of(app, n: int, rounds: int = 5) -> float:
    return min(asyncio.run(_per_request_us(app, n)) for _ in range(rounds))


def main() -> None:
    print(f"{'chunks':>6} {'route':>16} {'bare us':>9} {'wrapped us':>11} {'added us':>9} {'ratio':>6}")
    for chunks in (1, 100, 1000):
        inner = inner_app(chunks)
        n = max(200, 20000 // chunks)
        for hooked in (True, False):
            wrapped = routes._route_app(inner, routes.Route(semconv.OP_CHAT, handler_hooked=hooked), None)
            bare, ours = best_of(inner, n), best_of(wrapped, n)
            kind = "handler-hooked" if hooked else "no handler hook"
            print(f"{chunks:>6} {kind:>16} {bare:>9.2f} {ours:>11.2f} {ours - bare:>9.2f} {ours / bare:>6.2f}")


if __name__ == "__main__":
    main()

"""Live counting's cost on the API server (otel_llm/vllm/live.py), with stand-in vLLM request states
(the same reads as on a server), the real spool and the in-process metric instruments:

- per request: a short request's telemetry (start, engine request attached, end with its bill and
  metrics) with OTEL_LLM_LIVE_INTERVAL=5 against 0 (off): what tracking it costs on the event loop;
- per sweep, per request in flight longer than the interval: one whose tokens grew (a progress
  record and a counter increment) and one that did not (read only).

    .venv/bin/python benchmarks/live_counting.py [--requests 20000] [--in-flight 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from otel_llm import semconv  # noqa: E402
from otel_llm.config import Settings  # noqa: E402
from otel_llm.vllm.request_telemetry import RequestInfo, start_request  # noqa: E402
from otel_llm.vllm.sink import InProcessSink
from otel_llm.vllm.telemetry import Telemetry  # noqa: E402

INFO = RequestInfo(operation=semconv.OP_CHAT, model="m", stream=True, tenant="acme", scene="s", cost_center="cc")


def engine_state(i: int, generated: list) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=f"r{i}",
        external_req_id=f"chatcmpl-r{i}",
        prompt_len=100,
        num_cached_tokens=16,
        stats=None,
        parent_req=None,
        request_index=0,
        detokenizer=SimpleNamespace(num_output_tokens=lambda: generated[0]),
    )


def telemetry(spool: str, interval: float) -> Telemetry:
    return Telemetry(
        InProcessSink(TracerProvider().get_tracer("bench"), MeterProvider().get_meter("bench")),
        MeterProvider().get_meter("bench"),
        Settings(usage_dir=spool, usage_fsync_interval_s=0, live_interval_s=interval),
        {semconv.SERVICE_INSTANCE_ID: "host:8000"},
    )


def per_request_us(interval: float, n: int) -> float:
    with tempfile.TemporaryDirectory() as spool:
        tel = telemetry(spool, interval)
        generated = [50]
        states = [engine_state(i, generated) for i in range(n)]
        start = time.perf_counter()
        for state in states:
            record = start_request(tel, INFO)
            record.attach_engine_request(state)
            record.end()
        return (time.perf_counter() - start) / n * 1e6


def per_sweep_us(n: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as spool:
        tel = telemetry(spool, 1.0)
        generated = [0]
        long_ago = time.time_ns() - 60 * 1_000_000_000
        for i in range(n):
            start_request(tel, INFO, start_ns=long_ago).attach_engine_request(engine_state(i, generated))
        grew, same = [], []
        for _ in range(5):
            generated[0] += 10
            start = time.perf_counter()
            assert tel.live.sweep() == n
            grew.append((time.perf_counter() - start) / n * 1e6)
            start = time.perf_counter()
            assert tel.live.sweep() == 0
            same.append((time.perf_counter() - start) / n * 1e6)
        return statistics.median(grew), statistics.median(same)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=1000)
    args = parser.parse_args(argv)
    per_request_us(0.0, 1000)  # warm up
    off = statistics.median(per_request_us(0.0, args.requests) for _ in range(3))
    on = statistics.median(per_request_us(5.0, args.requests) for _ in range(3))
    grew, same = per_sweep_us(args.in_flight)
    print(
        f"a short request's telemetry: {on:.1f} us with live counting, {off:.1f} us without "
        f"(ratio {on / off:.3f}, +{on - off:.2f} us)"
    )
    print(
        f"a sweep, per request in flight: {grew:.1f} us when its tokens grew (progress record + increment), "
        f"{same:.1f} us when not ({args.in_flight} in flight)"
    )
    print(
        f"at the default 5 s interval, {args.in_flight} long requests in flight: {grew * args.in_flight / 1e3:.1f} ms "
        f"of event-loop time per sweep ({grew * args.in_flight / 5e6 * 100:.2f} % of the loop)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

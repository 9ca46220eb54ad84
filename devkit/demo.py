"""`make demo`: one trace from an app through a gateway into the vLLM engine, printed as a tree.

Starts, on CPU with the tiny model: `opentelemetry-instrument vllm serve`, the example gateway
(examples/gateway, API key -> tenant) and the example app (examples/app, the OpenAI client under
`opentelemetry-instrument`), all exporting OTLP to a receiver in this process.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from devkit.devserver import GatewayServer, VLLMServer, otlp_env, run_app, write_keys_file
from devkit.otlp_receiver import Receiver
from devkit.trace_tree import render
from otel_llm import semconv

APP_SERVICE = "llm-app"
DEMO_KEY = "sk-demo-acme"  # the gateway maps it to tenant acme, scene support


def _trace_of(receiver: Receiver, response_id: str, timeout: float = 20.0):
    """The trace whose app CLIENT span got this response id, once the engine's phases are in."""

    def done(rx):
        for spans in rx.traces().values():
            if (
                any(
                    s.kind == "CLIENT"
                    and s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id
                    and s.resource.get("service.name") == APP_SERVICE
                    for s in spans
                )
                and len([s for s in spans if s.name in semconv.PHASE_SPANS]) >= 3
            ):
                return spans
        return None

    try:
        return receiver.wait_for(done, timeout)
    except TimeoutError:
        return next(
            (
                spans
                for spans in receiver.traces().values()
                if any(s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id for s in spans)
            ),
            [],
        )


def _print_ledger(spool: Path) -> None:
    """The bill of the demo's calls, from the usage ledger the server wrote."""
    import argparse

    from otel_llm.billing import report

    print(f"== usage ledger (the source of bills): otel-llm report --ledger {spool} --by tenant,scene,model")
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    try:
        report.run(
            parser.parse_args(["--ledger", str(spool), "--by", "tenant,scene,model", "--range", "1h"]), now=time.time()
        )
    except Exception as exc:  # noqa: BLE001 - the demo's traces were shown; the ledger is a bonus
        print(f"   (ledger report unavailable: {exc})")
    print()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="otel-llm-demo-"))
    with Receiver() as receiver:
        print(
            f"OTLP receiver on {receiver.endpoint}; starting `opentelemetry-instrument vllm serve` "
            f"(tiny model, CPU; ~40 s; logs in {work})",
            flush=True,
        )
        spool = work / "usage"
        server = VLLMServer(
            env={**otlp_env(receiver.endpoint), "OTEL_LLM_USAGE_DIR": str(spool)},
            log_path=work / "vllm.log",
            extra_args=["--enable-prompt-tokens-details"],
        )
        started = time.monotonic()
        server.start()
        keys = write_keys_file(work / "keys.json", {DEMO_KEY: ("acme", "support")})
        gateway = GatewayServer(
            server.url,
            keys,
            log_path=work / "gateway.log",
            env=otlp_env(receiver.endpoint, service_name=semconv.GATEWAY_SERVICE_NAME),
        )
        try:
            gateway.start()
            print(
                f"vLLM ready at {server.url} and gateway at {gateway.url} in {time.monotonic() - started:.0f} s",
                flush=True,
            )
            print("running `opentelemetry-instrument python examples/app/app.py` (chat, then a stream)\n", flush=True)
            calls = []
            for call in ("chat", "stream"):
                calls += run_app(
                    call,
                    gateway.url + "/v1",
                    DEMO_KEY,
                    model=server.served_model_name,
                    env=otlp_env(receiver.endpoint, service_name=APP_SERVICE),
                )
            for line in calls:
                spans = _trace_of(receiver, line["response_id"])
                usage = line["usage"] or {}
                trace_id = spans[0].trace_id if spans else "?"
                print(f"== app call `{line['call']}`: trace {trace_id}")
                print(
                    f"   usage the app was billed: prompt={usage.get('prompt_tokens')} "
                    f"completion={usage.get('completion_tokens')}"
                )
                print(render(spans))
                print()
        finally:
            gateway.stop()
            server.stop()
    _print_ledger(spool)
    print(
        "Point the exporters at a real collector, Jaeger or Tempo instead:\n"
        "  OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 opentelemetry-instrument vllm serve MODEL"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

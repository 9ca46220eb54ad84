"""devkit/trace_tree.py: the trace tree the e2e tests and the demo print."""

from otel_llm import semconv


def test_trace_tree_names_the_service_where_it_changes():
    from devkit.otlp_receiver import Span
    from devkit.trace_tree import render

    def span(span_id, parent, name, kind, service, start, attributes=None):
        return Span(
            trace_id="t",
            span_id=span_id,
            parent_span_id=parent,
            name=name,
            kind=kind,
            start_ns=start,
            end_ns=start + 2_000_000,
            attributes=attributes or {},
            status="UNSET",
            status_message="",
            resource={"service.name": service},
            scope="s",
        )

    tree = render(
        [
            span("a", "", "chat m", "CLIENT", "app", 0, {semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 3}),
            span("b", "a", "POST /v1/chat/completions", "SERVER", "vllm", 1_000_000),
            span("c", "b", "chat m", "INTERNAL", "vllm", 1_000_000),
        ]
    )
    assert tree.splitlines() == [
        "chat m [CLIENT app] +0.0ms 2.0ms  usage.output_tokens=3",
        "└─ POST /v1/chat/completions [SERVER vllm] +1.0ms 2.0ms",
        "   └─ chat m [INTERNAL] +1.0ms 2.0ms",
    ]

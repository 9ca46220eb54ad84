"""Render traces as indented trees in a terminal (the demo's output)."""

from __future__ import annotations

from otel_llm import semconv

KEY_ATTRIBUTES = (
    semconv.GEN_AI_USAGE_INPUT_TOKENS,
    semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
    semconv.GEN_AI_RESPONSE_FINISH_REASONS,
    semconv.VLLM_QUEUE_SECONDS,
    semconv.VLLM_PREFILL_SECONDS,
    semconv.VLLM_DECODE_SECONDS,
    semconv.VLLM_TTFT_SECONDS,
    semconv.VLLM_STREAM_TTFT_SECONDS,
    semconv.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK,
    semconv.VLLM_ABORTED,
    semconv.TENANT_ID,
    semconv.ERROR_TYPE,
    "http.response.status_code",
)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def render(spans, key_attributes=KEY_ATTRIBUTES) -> str:
    """Spans (otlp_receiver.Span) of one trace -> a tree, children in start order."""
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list] = {}
    roots = []
    for s in spans:
        if s.parent_span_id and s.parent_span_id in by_id:
            children.setdefault(s.parent_span_id, []).append(s)
        else:
            roots.append(s)
    origin = min((s.start_ns for s in spans), default=0)
    lines: list[str] = []

    def service(span) -> str:
        return str(span.resource.get("service.name", ""))

    def walk(span, prefix: str, last: bool, depth: int, parent_service: str = "") -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        offset_ms = (span.start_ns - origin) / 1e6
        attrs = "  ".join(
            f"{k.rsplit('.', 2)[-2] + '.' + k.rsplit('.', 1)[-1] if k.count('.') > 1 else k}={_fmt(span.attributes[k])}"
            for k in key_attributes
            if k in span.attributes
        )
        status = " ERROR" if span.status == "ERROR" else ""
        name = service(span)
        kind = f"{span.kind} {name}" if name and name != parent_service else span.kind
        lines.append(
            f"{prefix}{branch}{span.name} [{kind}] +{offset_ms:.1f}ms {span.duration_s * 1e3:.1f}ms{status}"
            + (f"  {attrs}" if attrs else "")
        )
        kids = sorted(children.get(span.span_id, []), key=lambda s: s.start_ns)
        next_prefix = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        for i, kid in enumerate(kids):
            walk(kid, next_prefix, i == len(kids) - 1, depth + 1, name)

    for root in sorted(roots, key=lambda s: s.start_ns):
        if root.parent_span_id:
            lines.append(f"(parent {root.parent_span_id} not in this export)")
        walk(root, "", True, 0)
    return "\n".join(lines)

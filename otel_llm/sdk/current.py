"""The current OpenTelemetry Context and span as the request path reads and sets them: with the API's
ContextVar's own methods (C calls, no Python frame of the API's per call), where the API keeps the
context in its default runtime context (otel_llm/sdk/internals.py `context_variable`); else with the
API's functions, which do the same. The API server runs these a few times per request, and every
distinct Python function a request runs costs it cache misses (docs/api-server-cost.md)."""

from __future__ import annotations

from opentelemetry import context as context_api
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span

from otel_llm.sdk import internals

SPAN_KEY = internals.span_key()
BAGGAGE_KEY = internals.baggage_key()

_variable = internals.context_variable()
if _variable is None:  # (another runtime context: the API's functions)
    current_context = context_api.get_current
    attach = context_api.attach
    reset = context_api.detach
else:
    current_context = _variable.get
    attach = _variable.set  # (returns the token for `detach`)
    reset = _variable.reset


def detach(token) -> None:
    """context_api.detach: a token of another context is logged by the API, as it logs it."""
    try:
        reset(token)
    except Exception:  # noqa: BLE001
        context_api.detach(token)


def span_in(context: Context | None):
    """trace.get_current_span(context): the span a Context holds (None: the current one), INVALID_SPAN
    where it holds none."""
    span = (current_context() if context is None else context).get(SPAN_KEY)
    return span if isinstance(span, Span) else INVALID_SPAN

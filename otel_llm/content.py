"""Opt-in prompt and completion capture in the semconv `gen_ai.input.messages` /
`gen_ai.output.messages` shapes (JSON strings on the span), for the OpenAI client and the vLLM
server alike. Used only when the user sets OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT;
never called otherwise. Every text (message content, tool call arguments and responses) passes
the redactor before it is serialised, and is cut to the size caps with a marker saying how much
was cut. Only what can be kept is redacted: a text is first cut to its room plus REDACTION_MARGIN
characters, so a multi-megabyte prompt costs the redactor its first few tens of KB, and a secret
across the final cut is still seen whole (or, if longer than the margin, redacted to the end of
what is seen: every rule matches a cut key's head).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_llm import redaction, semconv
from otel_llm.config import ContentLimits

_log = logging.getLogger("otel_llm")

TRUNCATED = "…[otel-llm: {} characters cut]"
REDACTION_MARGIN = 8192  # characters redacted beyond a text's room (a PEM RSA-4096 key is 3.3 KB)


@dataclass
class Budget:
    """The size caps of one request's captured content: each text cut to `max_text` characters,
    all texts together to `max_total`; a cut text ends with the TRUNCATED marker."""

    max_text: int = ContentLimits.max_text
    max_total: int = ContentLimits.max_total
    used: int = 0

    def cut(self, text: str, redact: Callable[[str], str] = str) -> str:
        """`text` redacted and cut to the room left; only its first room + REDACTION_MARGIN characters
        are redacted."""
        room = max(0, min(self.max_text, self.max_total - self.used))
        if room == 0:
            return TRUNCATED.format(len(text)) if text else text
        seen = text[: room + REDACTION_MARGIN]
        redacted = redact(seen)
        kept = redacted[:room]
        self.used += len(kept)
        dropped = len(redacted) - len(kept) + len(text) - len(seen)
        return kept + TRUNCATED.format(dropped) if dropped else kept


class Capture:
    """What a layer needs to put content on its spans: the redactor (otel_llm/redaction.py), the
    size caps and the counter of redactions. Made only when capture is on."""

    def __init__(self, meter, environ=os.environ):
        self.redactor = redaction.from_environment(environ)
        limits = ContentLimits.from_env(environ)
        self.max_text, self.max_total = limits.max_text, limits.max_total
        self.redactions = semconv.create_instrument(meter, semconv.REDACTIONS)

    def set_attributes(self, attributes: dict, inputs: list[dict], outputs, reasons: dict) -> None:
        """gen_ai.input.messages / gen_ai.output.messages, redacted and capped; redactions counted."""
        found: dict[str, int] = {}

        def redact(text: str) -> str:
            text, counts = self.redactor.redact_counted(text)
            for rule, n in counts.items():
                found[rule] = found.get(rule, 0) + n
            return text

        add_to(attributes, inputs, outputs, reasons, redact, Budget(self.max_text, self.max_total))
        for rule, n in found.items():
            self.redactions.add(n, {semconv.REDACTION_RULE: rule})


def _text_part(text: str) -> dict:
    return {"type": "text", "content": text}


def _content_parts(content_value) -> list[dict]:
    if isinstance(content_value, str):
        return [_text_part(content_value)]
    parts = []
    for item in content_value or ():
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            parts.append(_text_part(item["text"]))
        elif isinstance(item, dict):
            parts.append({"type": str(item.get("type", "unknown"))})
    return parts


def _message(message) -> dict | None:
    if not isinstance(message, dict):
        message = getattr(message, "model_dump", lambda: None)()
        if not isinstance(message, dict):
            return None
    role = message.get("role", "user")
    parts = _content_parts(message.get("content"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        parts.append(
            {
                "type": "tool_call",
                "id": call.get("id"),
                "name": function.get("name"),
                "arguments": function.get("arguments"),
            }
        )
    if role == "tool":
        return {
            "role": "tool",
            "parts": [
                {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": message.get("content")}
            ],
        }
    return {"role": role, "parts": parts}


def input_messages(operation: str, kwargs: dict) -> list[dict] | None:
    if operation == semconv.OP_EMBEDDINGS:
        return None
    messages = kwargs.get("messages")
    if isinstance(messages, (list, tuple)):
        return [m for m in map(_message, messages) if m is not None]
    prompt = kwargs.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "parts": [_text_part(prompt)]}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(p, str) for p in prompt):
        return [{"role": "user", "parts": [_text_part(p) for p in prompt]}]
    result = []
    instructions = kwargs.get("instructions")
    if isinstance(instructions, str):
        result.append({"role": "system", "parts": [_text_part(instructions)]})
    given = kwargs.get("input")
    if isinstance(given, str):
        result.append({"role": "user", "parts": [_text_part(given)]})
    elif isinstance(given, (list, tuple)):
        result.extend(m for m in map(_message, given) if m is not None)
    return result


def add_stream_delta(output: dict[int, list], choices) -> None:
    for choice in choices:
        delta = getattr(choice, "delta", None)
        text = getattr(delta, "content", None) if delta is not None else getattr(choice, "text", None)
        if text:
            output.setdefault(choice.index, []).append(text)


def add_response_choices(output: dict[int, list], response) -> None:
    for choice in getattr(response, "choices", None) or ():
        parts = output.setdefault(choice.index, [])
        message = getattr(choice, "message", None)
        text = getattr(message, "content", None) if message is not None else getattr(choice, "text", None)
        if text:
            parts.append(text)
        for call in getattr(message, "tool_calls", None) or ():
            function = getattr(call, "function", None)
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.id,
                    "name": getattr(function, "name", None),
                    "arguments": getattr(function, "arguments", None),
                }
            )


def add_responses_output(output: dict[int, list], response) -> None:
    text = getattr(response, "output_text", None)
    if text:
        output[0] = [text]


def add_to(
    attributes: dict,
    inputs: list[dict],
    outputs: dict[int, list] | None,
    reasons: dict[int, str],
    redact: Callable[[str], str] = str,
    budget: Budget | None = None,
) -> None:
    """Sets gen_ai.input.messages (and gen_ai.output.messages when there is output), each text
    redacted, then cut to the budget (the input first: it is what the request was)."""
    budget = budget or Budget()

    def text(value: str) -> str:
        return budget.cut(value, redact)

    attributes[semconv.GEN_AI_INPUT_MESSAGES] = _dumps(_redacted(inputs, text))
    if not outputs:
        return
    messages = []
    for index in sorted(outputs):
        texts = [p for p in outputs[index] if isinstance(p, str)]
        parts: list[Any] = [_text_part("".join(texts))] if texts else []
        parts += [p for p in outputs[index] if isinstance(p, dict)]
        messages.append({"role": "assistant", "parts": parts, "finish_reason": reasons.get(index, "")})
    attributes[semconv.GEN_AI_OUTPUT_MESSAGES] = _dumps(_redacted(messages, text))


_TEXT_KEYS = ("content", "arguments", "response")


def _redacted(value, redact: Callable[[str], str], text: bool = False):
    """A copy with every string under _TEXT_KEYS (at any depth below them) passed through `redact`."""
    if isinstance(value, str):
        return redact(value) if text else value
    if isinstance(value, (list, tuple)):
        return [_redacted(v, redact, text) for v in value]
    if isinstance(value, dict):
        return {k: _redacted(v, redact, text or k in _TEXT_KEYS) for k, v in value.items()}
    return value


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)

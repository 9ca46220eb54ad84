"""Cost of redacting captured content (otel_llm/redaction.py), per core.

Prints microseconds per typical 2 KB prompt (plain prose; prose with dates, amounts and
percentages; prose with a handful of e-mails, phones, cards, IDs and addresses), throughput in MB/s over 1 MB of each, and the same for a
single precompiled e-mail regex as the floor of any regex pass, side by side in one run.

    .venv/bin/python benchmarks/redaction.py
"""

from __future__ import annotations

import re
import time

from otel_llm import redaction

PROSE = ("The platform team reviewed the latency report for the inference cluster and found that "
         "queue time grew during the nightly batch window; they proposed a separate pool for "
         "long prompts and a budget alert per tenant. ")
NUMBERS = ("On 2026-12-03 the p99 latency was 2.4 s for 1,250 requests per minute, up 12% on the "
           "week; 3 of 40 nodes ran at 95% of their 80 GB. ")
SENSITIVE = ("Contact jane.doe@example.com or +1 415 555 2671 from 10.0.12.7; card 4111 1111 1111 1111, "
             "ID 11010519491231002X, key sk-proj-Abcdefghijklmnop1234. ")


def text_of(size: int, kind: str) -> str:
    unit = PROSE * 3 + {"prose": PROSE, "numbers": NUMBERS, "sensitive": SENSITIVE}[kind]
    return (unit * (size // len(unit) + 1))[:size]


def per_call_us(fn, text: str, seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(50):
            fn(text)
        n += 50
    return elapsed / n * 1e6


def main() -> None:
    redactor = redaction.Redactor()
    email = re.compile(redaction.BUILTIN_RULES[1].pattern)
    print(f"{'text':<34} {'otel-llm us/2KB':>16} {'otel-llm MB/s':>14} {'one regex us/2KB':>17} {'ratio':>6}")
    for kind in ("prose", "numbers", "sensitive"):
        prompt, big = text_of(2048, kind), text_of(1 << 20, kind)
        ours = per_call_us(redactor.redact, prompt)
        floor = per_call_us(lambda t: email.sub("<EMAIL>", t), prompt)
        mb_s = 1.0 / (per_call_us(redactor.redact, big, seconds=2.0) / 1e6)
        found = redactor.redact_counted(prompt)[1]
        label = {"prose": "prose", "numbers": "prose with numbers"}.get(kind) or \
            "prose + " + ", ".join(f"{v} {k}" for k, v in sorted(found.items()))
        print(f"{label[:34]:<34} {ours:>16.1f} {mb_s:>14.1f} {floor:>17.1f} {ours / floor:>6.1f}")


if __name__ == "__main__":
    main()

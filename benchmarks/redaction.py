"""Cost of redacting captured content (otel_llm/redaction.py), per core.

Prints, side by side in one run, microseconds per typical 2 KB prompt and MB/s over 1 MB for:
typical English prose, prose with numbers, prose with a handful of e-mails, phones, cards, IDs and
addresses, CJK text, code and config with secrets in it, and the adversarial texts of
tests/content/test_redaction_time.py (the slowest of them, and their median).

    .venv/bin/python benchmarks/redaction.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

from otel_llm import redaction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROSE = (
    "The platform team reviewed the latency report for the inference cluster and found that "
    "queue time grew during the nightly batch window; they proposed a separate pool for "
    "long prompts and a budget alert per tenant. "
)
NUMBERS = (
    "On 2026-12-03 the p99 latency was 2.4 s for 1,250 requests per minute, up 12% on the "
    "week; 3 of 40 nodes ran at 95% of their 80 GB. "
)
SENSITIVE = (
    "Contact jane.doe@example.com or +1 415 555 2671 from 10.0.12.7; card 4111 1111 1111 1111, "
    "ID 11010519491231002X, key sk-proj-Abcdefghijklmnop1234. "
)
CJK = (
    "平台团队审查了推理集群的延迟报告，发现夜间批处理窗口期间排队时间增加；他们建议为长提示词设立单独的资源池，"
    "并为每个租户设置预算告警。"
)


def _code() -> str:
    """A pasted config file and script with a few secrets of random formats."""
    from content.secret_formats import FORMATS

    rng = random.Random(1)
    keys = [FORMATS[name](rng) for name in ("openai_project_key", "github_token", "aws_access_key_id", "stripe_key")]
    return (
        'import os\nfrom openai import OpenAI\n\nclient = OpenAI(api_key=os.environ["OPENAI_API_KEY"])\n'
        'def handler(event, context):\n    for record in event["Records"]:\n        print(record["body"])\n'
        f"# .env\nOPENAI_API_KEY={keys[0]}\nGITHUB_TOKEN={keys[1]}\nDEBUG=true\nLOG_LEVEL=info\n"
        f"aws_access_key_id = {keys[2]}\nDATABASE_URL=postgres://app:s3cr3t-pw@db.internal:5432/app\n"
        f"stripe:\n  secret: {keys[3]}\n  timeout_ms: 3000\n"
    )


def text_of(size: int, kind: str) -> str:
    unit = {
        "prose": PROSE,
        "numbers": PROSE * 3 + NUMBERS,
        "sensitive": PROSE * 3 + SENSITIVE,
        "cjk": CJK,
        "code": _code(),
    }[kind]
    return (unit * (size // len(unit) + 1))[:size]


def per_call_us(fn, text: str, seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(20):
            fn(text)
        n += 20
    return elapsed / n * 1e6


def mb_s(fn, text: str, seconds: float = 1.0) -> float:
    return len(text.encode()) / (per_call_us(fn, text, seconds) / 1e6) / 1e6


def main() -> None:
    from content.test_redaction_time import ADVERSARIAL

    redactor = redaction.Redactor()
    print(f"{'text':<46} {'us/2KB':>9} {'MB/s (1 MB)':>12}")
    for kind, label in (
        ("prose", "typical English prose"),
        ("numbers", "prose with numbers"),
        ("sensitive", "prose with PII"),
        ("cjk", "CJK text"),
        ("code", "code and config with secrets"),
    ):
        prompt, big = text_of(2048, kind), text_of(1 << 20, kind)
        found = redactor.redact_counted(prompt)[1]
        extra = f" ({sum(found.values())} redacted)" if found else ""
        print(
            f"{(label + extra)[:46]:<46} {per_call_us(redactor.redact, prompt):>9.1f} "
            f"{mb_s(redactor.redact, big, seconds=2.0):>12.1f}"
        )
    rates = {name: mb_s(redactor.redact, make(64 << 10), seconds=0.3) for name, make in ADVERSARIAL.items()}
    slowest = sorted(rates, key=rates.get)[:5]
    print(
        f"{'adversarial (64 KB), median of ' + str(len(rates)):<46} {'':>9} {statistics.median(rates.values()):>12.1f}"
    )
    for name in slowest:
        print(f"{'  slowest: ' + name[:35]:<46} {'':>9} {rates[name]:>12.2f}")


if __name__ == "__main__":
    main()

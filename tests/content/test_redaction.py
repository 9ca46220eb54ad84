"""The redaction rules: every built-in rule with text it must replace and text it must leave."""

import json
import logging

import pytest
from content.redaction_examples import NEGATIVE, POSITIVE

from otel_llm import config, redaction, semconv


@pytest.mark.parametrize("rule, text, match", POSITIVE, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(POSITIVE)])
def test_builtin_rule_replaces_its_match(rule, text, match):
    token = next(x.replacement for x in redaction.BUILTIN_RULES if x.name == rule)
    assert redaction.Redactor().redact_counted(text) == (text.replace(match, token), {rule: 1})


@pytest.mark.parametrize("text", NEGATIVE)
def test_lookalikes_are_left_alone(text):
    assert redaction.Redactor().redact_counted(text) == (text, {})


def test_check_digits():
    assert redaction.luhn_valid("4111111111111111") and not redaction.luhn_valid("4111111111111112")
    assert redaction.prc_id_valid("11010519491231002X") and redaction.prc_id_valid("11010519491231002x")
    assert not redaction.prc_id_valid("110105194912310021")


def test_luhn_check_matches_the_textbook_algorithm_on_random_numbers():
    import random

    def textbook(number):
        digits = [int(c) for c in number if c.isdigit()]
        doubled = [d * 2 - 9 * (d > 4) if i % 2 else d for i, d in enumerate(reversed(digits))]
        return 13 <= len(digits) <= 19 and sum(doubled) % 10 == 0

    rng = random.Random(7)
    numbers = ["".join(rng.choice("0123456789") for _ in range(rng.randint(11, 21))) for _ in range(5000)]
    numbers += [" ".join(n[i : i + 4] for i in range(0, len(n), 4)) for n in numbers[:2500]]
    numbers += ["-".join(n[i : i + 4] for i in range(0, len(n), 4)) for n in numbers[:2500]]
    assert sum(map(textbook, numbers)) > 300  # (about a tenth of those of a right length)
    assert [redaction.luhn_valid(n) for n in numbers] == [textbook(n) for n in numbers]


def test_the_public_re2_api_gives_the_same_redactions_as_the_compiled_program():
    """Where google-re2's compiled program is not reachable (another release), its public API is used."""
    fast, public = redaction.Redactor(), redaction.Redactor()
    programs = [public._first.finder, *public._first.own, public._specific.finder, *public._specific.own]
    assert all(p._raw is not None for p in programs)  # (this release: the fast path is the one tested elsewhere)
    for p in programs:
        p._raw = None
    texts = (
        [text for _, text, _ in POSITIVE]
        + list(NEGATIVE)
        + [
            "x 4111 1111 1111 1112 4111 1111 1111 1111 a@b.com +1 415 555 2671 ::1 10.0.0.1 é token=Zx8vQ2mL9pR4tY7w",
            "export OPENAI_API_KEY=sk-proj-Q3v8Xk2Lm9Tz4Rb7Yw1Nc6Hd0Jf5Gp_Aa-Ss8Dd7Ff6Gg5Hh4Jj3Kk2 请 a.a.a.a@",
        ]
    )
    for text in texts:
        assert public.redact_counted(text) == fast.redact_counted(text), text


def test_many_matches_counted_per_rule():
    text = "a@b.io, c@d.io, 4111111111111111, 10.0.0.1"
    assert redaction.Redactor().redact_counted(text) == (
        "<EMAIL>, <EMAIL>, <PAYMENT_CARD>, <IP_ADDRESS>",
        {semconv.REDACTION_RULE_EMAIL: 2, semconv.REDACTION_RULE_PAYMENT_CARD: 1, semconv.REDACTION_RULE_IP_ADDRESS: 1},
    )


def test_an_18_digit_number_failing_the_id_check_can_still_be_a_card():
    # 18 digits, Luhn-valid, not a valid resident ID (month 00)
    number = next(str(n) for n in range(400000000000000000, 400000000000001000) if redaction.luhn_valid(str(n)))
    assert not redaction.prc_id_valid(number)
    assert redaction.Redactor().redact_counted(f"pay {number}") == (
        "pay <PAYMENT_CARD>",
        {semconv.REDACTION_RULE_PAYMENT_CARD: 1},
    )


def test_user_rules_file(tmp_path, caplog):
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            [
                {"name": "employee_id", "pattern": r"EMP-\d{6}", "replacement": "<EMPLOYEE>"},
                {"name": "broken", "pattern": "("},
                {"pattern": "no name"},
            ]
        )
    )
    with caplog.at_level(logging.WARNING, logger="otel_llm.redaction"):
        r = redaction.from_environment({config.ENV_REDACTION_RULES: str(rules)})
    assert r.redact_counted("EMP-123456 wrote to x@y.org") == (
        "<EMPLOYEE> wrote to <EMAIL>",
        {"employee_id": 1, semconv.REDACTION_RULE_EMAIL: 1},
    )
    assert len([m for m in caplog.messages if "skipped" in m]) == 2


def test_unreadable_rules_file_keeps_builtins(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="otel_llm.redaction"):
        r = redaction.from_environment({config.ENV_REDACTION_RULES: str(tmp_path / "missing.json")})
    assert r.redact("x@y.org") == "<EMAIL>"
    assert any("could not be read" in m for m in caplog.messages)


def test_callable_redactors_run_last_and_a_failing_one_is_skipped(caplog):
    def upper_names(text):
        return text.replace("Alice", "<NAME>")

    def broken(text):
        raise RuntimeError("bug")

    r = redaction.Redactor(callables=[broken, upper_names])
    with caplog.at_level(logging.WARNING, logger="otel_llm.redaction"):
        assert r.redact_counted("Alice <alice@example.com>") == (
            "<NAME> <<EMAIL>>",
            {"upper_names": 1, semconv.REDACTION_RULE_EMAIL: 1},
        )
        assert r.redact("Alice again") == "<NAME> again"
    assert len([m for m in caplog.messages if "failed" in m]) == 1


def test_content_budget_cuts_each_text_then_the_request():
    from otel_llm import content

    budget = content.Budget(max_text=5, max_total=8)
    assert [budget.cut(t) for t in ("abc", "defghij", "klm", "")] == [
        "abc",
        "defgh" + content.TRUNCATED.format(2),
        content.TRUNCATED.format(3),
        "",
    ]


def test_only_what_can_be_kept_is_redacted_and_a_key_across_the_cut_is_not_leaked():
    from otel_llm import content

    key = "sk-proj-Q3v8Xk2Lm9Tz4Rb7Yw1Nc6Hd0Jf5Gp_Aa-Ss8Dd7Ff6Gg5Hh4Jj3Kk2"
    seen = []

    def redact(text):
        seen.append(len(text))
        return redaction.Redactor().redact(text)

    prompt = "x" * 990 + " " + key + " " + "y" * 2_000_000
    got = content.Budget(max_text=1000, max_total=5000).cut(prompt, redact)
    assert seen == [1000 + content.REDACTION_MARGIN]
    assert got == "x" * 990 + " <SECRET> " + content.TRUNCATED.format(len(prompt) - 1000 - len(key) + 8)
    # a key longer than the margin reaching past it: what is seen of it is redacted
    import random

    rng = random.Random(1)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789"
    text = "token=" + "".join(rng.choice(alphabet) for _ in range(2 * content.REDACTION_MARGIN))
    got = content.Budget(max_text=100, max_total=100).cut(text, redact)
    assert got == "token=<SECRET>" + content.TRUNCATED.format(len(text) - 100 - content.REDACTION_MARGIN)
    # the budget spent, nothing is redacted (or kept)
    budget = content.Budget(max_text=10, max_total=10)
    budget.cut("0123456789", redact)
    seen.clear()
    assert budget.cut("a@b.io", redact) == content.TRUNCATED.format(6) and seen == []


def test_content_caps_from_the_environment(caplog):
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_llm import content

    meter = MeterProvider().get_meter("test")
    capture = content.Capture(meter, {config.ENV_CONTENT_MAX_TEXT_LENGTH: "10", config.ENV_CONTENT_MAX_LENGTH: "lots"})
    assert (capture.max_text, capture.max_total) == (10, config.ContentLimits.max_total)
    assert any(config.ENV_CONTENT_MAX_LENGTH in m for m in caplog.messages)
    # a negative cap is no cap at all: the default applies
    capture = content.Capture(meter, {config.ENV_CONTENT_MAX_TEXT_LENGTH: "-5", config.ENV_CONTENT_MAX_LENGTH: "-1"})
    assert (capture.max_text, capture.max_total) == (config.ContentLimits.max_text, config.ContentLimits.max_total)


@pytest.mark.parametrize(
    "text,redacted",
    [
        # a letter of another script is no word boundary in Unicode's sense: the secret or the e-mail's
        # first part would leak whole
        ("邮箱jane.doe@example.com谢谢", "邮箱<EMAIL>谢谢"),
        ("密钥sk-proj-abcdefghijklmnopqrstuv1234结束", "密钥<SECRET>结束"),
        ("令牌AKIAABCDEFGHIJKLMNOP吗", "令牌<SECRET>吗"),
        # an address that ends a sentence
        ("the server is 10.0.0.1.", "the server is <IP_ADDRESS>."),
        ("version 1.2.3.4.5 stays", "version 1.2.3.4.5 stays"),
    ],
)
def test_rules_hold_next_to_other_scripts_and_punctuation(text, redacted):
    assert redaction.Redactor().redact(text) == redacted


def test_a_name_after_a_name_is_not_the_value():
    # `TOKEN=API_KEY: 'value'`: API_KEY: is the next name; the value after it is the secret
    assert redaction.Redactor().redact("export TOKEN=API_KEY: 'q8Zr3kLm9Pw2Xv7N'") == "export TOKEN=API_KEY: '<SECRET>'"

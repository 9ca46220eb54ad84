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


def test_many_matches_counted_per_rule():
    text = "a@b.io, c@d.io, 4111111111111111, 10.0.0.1"
    assert redaction.Redactor().redact_counted(text) == (
        "<EMAIL>, <EMAIL>, <PAYMENT_CARD>, <IP_ADDRESS>",
        {semconv.REDACTION_RULE_EMAIL: 2, semconv.REDACTION_RULE_PAYMENT_CARD: 1, semconv.REDACTION_RULE_IP_ADDRESS: 1})


def test_an_18_digit_number_failing_the_id_check_can_still_be_a_card():
    # 18 digits, Luhn-valid, not a valid resident ID (month 00)
    number = next(str(n) for n in range(400000000000000000, 400000000000001000) if redaction.luhn_valid(str(n)))
    assert not redaction.prc_id_valid(number)
    assert redaction.Redactor().redact_counted(f"pay {number}") == ("pay <PAYMENT_CARD>",
                                                                    {semconv.REDACTION_RULE_PAYMENT_CARD: 1})


def test_user_rules_file(tmp_path, caplog):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"name": "employee_id", "pattern": r"EMP-\d{6}", "replacement": "<EMPLOYEE>"},
                                 {"name": "broken", "pattern": "("},
                                 {"pattern": "no name"}]))
    with caplog.at_level(logging.WARNING, logger="otel_llm.redaction"):
        r = redaction.from_environment({config.ENV_REDACTION_RULES: str(rules)})
    assert r.redact_counted("EMP-123456 wrote to x@y.org") == ("<EMPLOYEE> wrote to <EMAIL>",
                                                               {"employee_id": 1, semconv.REDACTION_RULE_EMAIL: 1})
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
            "<NAME> <<EMAIL>>", {"upper_names": 1, semconv.REDACTION_RULE_EMAIL: 1})
        assert r.redact("Alice again") == "<NAME> again"
    assert len([m for m in caplog.messages if "failed" in m]) == 1


def test_content_budget_cuts_each_text_then_the_request():
    from otel_llm import content

    budget = content.Budget(max_text=5, max_total=8)
    assert [budget.cut(t) for t in ("abc", "defghij", "klm", "")] == [
        "abc", "defgh" + content.TRUNCATED.format(2), content.TRUNCATED.format(3), ""]


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


@pytest.mark.parametrize("text,redacted", [
    # a letter of another script is no word boundary in Unicode's sense: the secret or the e-mail's
    # first part would leak whole
    ("邮箱jane.doe@example.com谢谢", "邮箱<EMAIL>谢谢"),
    ("密钥sk-proj-abcdefghijklmnopqrstuv1234结束", "密钥<SECRET>结束"),
    ("令牌AKIAABCDEFGHIJKLMNOP吗", "令牌<SECRET>吗"),
    # an address that ends a sentence
    ("the server is 10.0.0.1.", "the server is <IP_ADDRESS>."),
    ("version 1.2.3.4.5 stays", "version 1.2.3.4.5 stays"),
])
def test_rules_hold_next_to_other_scripts_and_punctuation(text, redacted):
    assert redaction.Redactor().redact(text) == redacted


def test_a_name_after_a_name_is_not_the_value():
    # `TOKEN=API_KEY: 'value'`: API_KEY: is the next name; the value after it is the secret
    assert redaction.Redactor().redact("export TOKEN=API_KEY: 'q8Zr3kLm9Pw2Xv7N'") == "export TOKEN=API_KEY: '<SECRET>'"

"""The redaction rules: every built-in rule with text it must replace and text it must leave."""

import json
import logging

import pytest

from otel_llm import config, redaction, semconv

# (rule, text containing exactly one match, the match)
POSITIVE = [
    (semconv.REDACTION_RULE_SECRET, "curl -H 'Authorization: Bearer abc.DEF_123-xyz' url", "abc.DEF_123-xyz"),
    (semconv.REDACTION_RULE_SECRET, "key sk-proj-Abcdefghijklmnop1234 here", "sk-proj-Abcdefghijklmnop1234"),
    (semconv.REDACTION_RULE_SECRET, "aws AKIAIOSFODNN7EXAMPLE.", "AKIAIOSFODNN7EXAMPLE"),
    (semconv.REDACTION_RULE_SECRET, "token ghp_" + "a1" * 18 + " ok", "ghp_" + "a1" * 18),
    (semconv.REDACTION_RULE_SECRET, "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"),
    (semconv.REDACTION_RULE_EMAIL, "write to jane.doe+billing@example.co.uk today", "jane.doe+billing@example.co.uk"),
    (semconv.REDACTION_RULE_PAYMENT_CARD, "card 4111 1111 1111 1111 exp 12/29", "4111 1111 1111 1111"),
    (semconv.REDACTION_RULE_PAYMENT_CARD, "card 5500-0000-0000-0004.", "5500-0000-0000-0004"),
    (semconv.REDACTION_RULE_PAYMENT_CARD, "amex 378282246310005", "378282246310005"),
    (semconv.REDACTION_RULE_PRC_ID, "身份证号 11010519491231002X 的持有人", "11010519491231002X"),
    (semconv.REDACTION_RULE_PRC_ID, "id 440524188001010014", "440524188001010014"),
    (semconv.REDACTION_RULE_PHONE, "call +1 415 555 2671 now", "+1 415 555 2671"),
    (semconv.REDACTION_RULE_PHONE, "call (415) 555-2671 now", "(415) 555-2671"),
    (semconv.REDACTION_RULE_PHONE, "call 415-555-2671 now", "415-555-2671"),
    (semconv.REDACTION_RULE_PHONE, "手机 13812345678 联系", "13812345678"),
    (semconv.REDACTION_RULE_PHONE, "tel +44 20 7946 0958.", "+44 20 7946 0958"),
    (semconv.REDACTION_RULE_IP_ADDRESS, "from 192.168.10.254 we", "192.168.10.254"),
    (semconv.REDACTION_RULE_IP_ADDRESS, "v6 2001:db8::8a2e:370:7334 here", "2001:db8::8a2e:370:7334"),
    (semconv.REDACTION_RULE_IP_ADDRESS, "loopback ::1 only", "::1"),
    (semconv.REDACTION_RULE_IP_ADDRESS, "fe80:0:0:0:202:b3ff:fe1e:8329 link", "fe80:0:0:0:202:b3ff:fe1e:8329"),
]

# text that looks close to a rule and must stay as it is
NEGATIVE = [
    "card 4111 1111 1111 1112 fails Luhn",
    "id 11010519491231002 is 17 digits",
    "id 110105194912310021 has a wrong check digit",
    "id 110105194913310026 has month 13",
    "version 1.2.3.4.5 and 999.1.1.1 are not addresses",
    "the time is 12:30:45 and the ratio 3:2",
    "order #12345 costs 1234.56 dollars on 2026-12-03",
    "skip-this-word and sk-short are not keys",
    "a bearer of news",
    "email me at jane at example dot com",
    "the year 2026 and 100000 tokens",
]


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

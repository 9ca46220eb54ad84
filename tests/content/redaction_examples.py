"""The built-in redaction rules' examples: text each rule must replace, and lookalikes every rule
must leave. Used by content/test_redaction.py (the servers' redactor) and by
collector/test_collector_config.py (the collector's second redaction gives the servers' result)."""

from otel_llm import semconv

SECRET = semconv.REDACTION_RULE_SECRET + "."  # secrets are counted by format: secret.<row of secret_rules.py>

# (rule, text containing exactly one match, the match)
POSITIVE = [
    (SECRET + "authorization_header", "curl -H 'Authorization: Bearer abc.DEF_123-xyz' url", "abc.DEF_123-xyz"),
    (SECRET + "openai_api_key", "key sk-proj-Abcdefghijklmnop1234 here", "sk-proj-Abcdefghijklmnop1234"),
    (SECRET + "aws_access_key_id", "aws AKIAIOSFODNN7EXAMPLE.", "AKIAIOSFODNN7EXAMPLE"),
    (SECRET + "github_token", "token ghp_" + "a1" * 18 + " ok", "ghp_" + "a1" * 18),
    (
        SECRET + "jwt",
        "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ),
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

"""The secret rule table: one row per format, as data, with its source.

Each row's `pattern` is RE2 syntax (no lookaround, no backreference): otel_llm/redaction.py runs all
rows as one RE2 alternation (linear time in the text by construction), and the collector's
second-line redaction (collector-config/otelcol.yaml, transform/content_redaction) runs the same
rows, generated from this table by `otel-llm rules` (tools: see collector_statements below).

A row's match is the secret, or, where the row has a `(?P<secret>...)` group, only that group (the
rest, such as `password=` or `Authorization: Bearer `, stays readable). `left` lists the characters
that may not stand right before a match (the run's own alphabet: a match starts only where a run
starts, so a failed candidate is never retried inside its run); `right`, if set, those that may not
follow it (a fixed-length format followed by more of its alphabet is not that format). `check`,
if set, runs on the server only (the collector cannot run code): a candidate that fails it is left
as it is. Counted in otel_llm.redactions as `secret.<name>`.

Sources: gitleaks config/gitleaks.toml (rule ids noted per row), Yelp detect-secrets plugins,
GitHub secret scanning's supported patterns and each provider's documented token format.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

WORD = "A-Za-z0-9_"
URLSAFE = "A-Za-z0-9_-"
URLSAFE_DOT = "A-Za-z0-9_.-"
BASE64 = "A-Za-z0-9+/"
# a quoted or unquoted value in code, config and .env files: up to a quote, blank, separator or markup
# (not starting with two dashes: -----BEGIN ... PRIVATE KEY----- is the private-key rule's)
_VALUE = r"(?:[^ \t\r\n\"'`,;{}\\)\]<>-]|-[^ \t\r\n\"'`,;{}\\)\]<>-])[^ \t\r\n\"'`,;{}\\)\]<>]{2,}"  # 4 or more
_VALUE8 = _VALUE[:-4] + "{6,}"  # 8 or more
_SEP = r"[\"']?[ \t]*(?:=>|:=|=|:)[ \t]*[\"']?"  # name = value, name: value, "name": "value", name => value
# the JSON-escaped forms (the collector sees content as a JSON string: `"` is `\"`, a newline `\n`)
_FIRST_JSON = r"(?:[^ \"'`,;{}\\)\]<>-]|-[^ \"'`,;{}\\)\]<>-])"
_VALUE_JSON = _FIRST_JSON + r"[^ \"'`,;{}\\)\]<>]{3,}"
_SEP_JSON = r"(?:\\\"|')?[ ]*(?:=>|:=|=|:)[ ]*(?:\\\"|')?"

PASSWORD_NAMES = r"passw(?:or)?d|passphrase|pwd"
SECRET_NAMES = (
    r"secret|token|api[_-]?key|access[_-]?key|private[_-]?key|secret[_-]?key|credentials?"
    r"|(?:signing|encryption|master|session|account)[_-]?key"
)
_NAME = r"(?i:[a-z0-9_.-]*(?:{}))"


@dataclass(frozen=True)
class SecretRule:
    name: str
    pattern: str
    source: str
    left: str = WORD
    right: str | None = None
    check: Callable[[str], bool] | None = None
    # the RE2 form for the collector where the JSON-escaped text needs another one (quotes, newlines)
    # or where the server's check has no regex equivalent (the collector then redacts more)
    collector: str | None = None
    # where the pattern has no literal head: the short RE2 a match starts with (the server's search
    # looks for these heads first; see otel_llm/redaction.py)
    head: str | None = None


# ---- checks (server only) ---------------------------------------------------------------------

_RUN16 = re.compile(r"[A-Za-z0-9_]{16}")


def has_digit(text: str) -> bool:
    return any(c in text for c in "0123456789")


def sk_key(text: str) -> bool:
    """The old sk-/pk-/rk- rule's shape: a run of 16 key characters, and a digit (kebab-case words
    such as sk-learn-compatible-estimators have neither)."""
    return has_digit(text) and _RUN16.search(text) is not None


def bearer_token(text: str) -> bool:
    """A token, not a word: a digit, or an upper-case letter after the first character
    ("Bearer authentication", "Bearer Authentication." are prose)."""
    return has_digit(text) or any(c.isupper() for c in text[1:])


def entropy(text: str) -> float:
    """Shannon entropy in bits per character."""
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values()) if n else 0.0


_PLACEHOLDERS = frozenset(
    {
        "none",
        "null",
        "nil",
        "true",
        "false",
        "undefined",
        "empty",
        "required",
        "optional",
        "string",
        "str",
        "bytes",
        "secret",
        "password",
        "token",
        "redacted",
        "hidden",
    }
)
_VARIABLE = re.compile(r"\$\{.*|\$\(.*|\$[A-Z_][A-Z0-9_]*|%\(.*|%[A-Za-z_][A-Za-z0-9_]*%|\{\{.*|<.*")
# snake_case, CONSTANT, camelCase, ClassName
_IDENTIFIER = r"(?:[a-z_][a-z0-9_]*|[A-Z_][A-Z0-9_]*|[a-z]+(?:[A-Z][a-z]+)*|(?:[A-Z][a-z]+)+)"
_REFERENCE = re.compile(rf"{_IDENTIFIER}(?:(?:\.{_IDENTIFIER})+[(\[]?|[(\[])")
# `TOKEN=API_KEY: 'value'`: what follows the first name is the next name, not its value
_NEXT_NAME = re.compile(rf"{_IDENTIFIER}[:=]")


def literal_value(value: str) -> bool:
    """A value written out, not a reference to one: not a variable (${X}, $X, %(x)s, %X%, {{x}}, <x>),
    a code expression (os.environ[, settings.SECRET_KEY, getpass.getpass(), a placeholder word or a
    mask (****, xxxx)."""
    return not (
        value.lower() in _PLACEHOLDERS
        or len(set(value.lower())) == 1
        or _VARIABLE.fullmatch(value) is not None
        or _REFERENCE.fullmatch(value) is not None
        or _NEXT_NAME.fullmatch(value) is not None
    )


def password_value(value: str) -> bool:
    """A password-like name's value: any literal of 4 or more characters (a weak password such as
    `hunter2` is still a password)."""
    return len(value) >= 4 and literal_value(value)


def secret_value(value: str) -> bool:
    """Another secret-looking name's value (token, key, secret, credentials): a literal of 8 or more
    characters from at least two classes (lower, upper, digit, other) with at least 3 bits of
    entropy per character (gitleaks' generic-api-key uses 3.5 on longer values; detect-secrets' keyword
    plugin has no threshold): `token: expired` and `api_key = get_key()` are code and prose."""
    if len(value) < 8 or not literal_value(value):
        return False
    classes = (
        any(c.islower() for c in value)
        + any(c.isupper() for c in value)
        + any(c.isdigit() for c in value)
        + any(not c.isalnum() for c in value)
    )
    return classes >= 2 and entropy(value) >= 3.0


def basic_credentials(value: str) -> bool:
    return len(value) >= 8


# ---- the table ---------------------------------------------------------------------------------


def _flag_rule(name: str, names: str, value: str, value_json: str, check, source: str) -> SecretRule:
    """A secret-looking name as a command-line flag: --name value, --name=value."""
    flag = "--" + _NAME.format(names)
    return SecretRule(
        name,
        flag + r"(?:[ \t]+|=)[\"']?" + f"(?P<secret>{value})",
        source,
        left=WORD + "-",
        check=check,
        collector=flag + r"(?:[ ]+|=)(?:\\\"|')?" + f"(?P<secret>{value_json})",
    )


def _xml_rule(name: str, names: str, min_length: int, check, source: str) -> SecretRule:
    """A secret-looking name as an XML element: <name>value</name>."""
    tag = "<" + _NAME.format(names) + ">"
    return SecretRule(
        name,
        tag + rf"(?P<secret>[^<\r\n]{{{min_length},}})</",
        source,
        check=check,
        collector=tag + f"(?P<secret>[^<\\\\]{{{min_length},}})</",
    )


_PEM_JSON = (
    r"-----BEGIN[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----"
    r"(?:[A-Za-z0-9+/= :,.]|\\[nrt\\]|-[A-Za-z0-9+/= :,.]|-\\[nrt\\])*"
    r"(?:-----END[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----)?"
)
_PEM = (
    r"-----BEGIN[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----"
    r"(?:[A-Za-z0-9+/= \t\r\n\\:,.]|-[A-Za-z0-9+/= \t\r\n\\:,.])*"
    r"(?:-----END[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----)?"
)

RULES: tuple[SecretRule, ...] = (
    # -- private keys first: their body holds runs any other rule could take a piece of
    SecretRule(
        "private_key",
        _PEM,
        collector=_PEM_JSON,
        source="gitleaks private-key; detect-secrets PrivateKeyDetector; RFC 7468 (also OpenSSH, "
        "PGP armor, and a GCP service-account JSON's private_key with \\n escapes; a block "
        "cut before its END line is redacted to the end of its base64)",
        left="-",
    ),
    # -- AI platforms
    SecretRule(
        "openai_api_key",
        r"sk-(?:proj|svcacct|admin|None)-[A-Za-z0-9_-]{16,}"
        r"|sk-[A-Za-z0-9_-]*T3BlbkFJ[A-Za-z0-9_-]*",
        "gitleaks openai-api-key; platform.openai.com key prefixes (project, service account, admin, "
        "legacy user keys with the T3BlbkFJ marker); body letters, digits, - and _",
        left=URLSAFE,
        check=has_digit,
    ),
    SecretRule(
        "anthropic_api_key",
        r"sk-ant-[a-z]{2,8}[0-9]{2}-[A-Za-z0-9_-]{20,}",
        "gitleaks anthropic-api-key, anthropic-admin-api-key (sk-ant-api03-, sk-ant-admin01- + 93 + AA)",
        left=URLSAFE,
    ),
    SecretRule(
        "sk_key",
        r"(?:sk|pk|rk)-[A-Za-z_-]*[0-9][A-Za-z0-9_-]*",
        "OpenAI-compatible providers' sk- keys (DeepSeek sk- + 32 hex, OpenRouter sk-or-v1- + 64 hex, "
        "Moonshot, DashScope, ...); a digit and a 16-character run",
        left=URLSAFE,
        check=sk_key,
    ),
    SecretRule(
        "huggingface_token",
        r"(?:hf|api_org)_[A-Za-z0-9]{34,}",
        "gitleaks huggingface-access-token, huggingface-organization-api-token (hf_ + 34)",
    ),
    SecretRule("groq_api_key", r"gsk_[A-Za-z0-9]{52,}", "console.groq.com key format (gsk_ + 52)"),
    SecretRule("replicate_token", r"r8_[A-Za-z0-9]{37,}", "replicate.com API token format (r8_ + 37)"),
    SecretRule(
        "perplexity_api_key", r"pplx-[A-Za-z0-9]{48,}", "gitleaks perplexity-api-key (pplx- + 48)", left=URLSAFE
    ),
    SecretRule("xai_api_key", r"xai-[A-Za-z0-9]{80,}", "console.x.ai key format (xai- + 80)", left=URLSAFE),
    SecretRule(
        "langsmith_api_key",
        r"lsv2_(?:pt|sk)_[a-f0-9]{32}_[a-f0-9]{10}",
        "LangSmith key format (lsv2_pt_/lsv2_sk_ + 32 hex + _ + 10 hex)",
        right=WORD,
    ),
    # -- cloud
    SecretRule(
        "aws_key_pair",
        r"(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}[ \t,:;|'\"=/]{1,5}"
        r"[A-Za-z0-9/+]{40}",
        "an access key ID followed by its 40-character secret access key (gitleaks aws-access-token; AWS IAM docs)",
        right=BASE64 + "=",
        collector=r"(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?:[ ,:;|'=/]|\\t|\\\"){1,5}"
        r"[A-Za-z0-9/+]{40}",
    ),
    SecretRule(
        "aws_access_key_id",
        r"(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}",
        "gitleaks aws-access-token; detect-secrets AWSKeyDetector (AKIA/ASIA/ABIA/ACCA + 16)",
        right=WORD,
    ),
    SecretRule(
        "google_api_key", r"AIza[A-Za-z0-9_-]{35}", "gitleaks gcp-api-key (AIza + 35)", left=URLSAFE, right=URLSAFE
    ),
    SecretRule(
        "google_oauth_client_secret",
        r"GOCSPX-[A-Za-z0-9_-]{28}",
        "Google OAuth client secret (GOCSPX- + 28)",
        left=URLSAFE,
        right=URLSAFE,
    ),
    SecretRule(
        "google_oauth_access_token",
        r"ya29\.[A-Za-z0-9_-]{30,}",
        "Google OAuth 2.0 access token (ya29.)",
        left=URLSAFE_DOT,
    ),
    SecretRule(
        "azure_storage_account_key",
        r"(?i:AccountKey)=(?P<secret>[A-Za-z0-9+/]{86}==)",
        "gitleaks azure-storage-account-key; Azure connection strings (AccountKey= + 88 base64)",
    ),
    SecretRule(
        "azure_ad_client_secret",
        r"[A-Za-z0-9_~.]{3}[0-9]Q~[A-Za-z0-9_~.-]{31,34}",
        "gitleaks azure-ad-client-secret",
        left=WORD + "~.-",
        right=WORD + "~.-",
        head=r"[A-Za-z0-9_~.]{3}[0-9]Q~",
    ),
    SecretRule(
        "digitalocean_token",
        r"do[opr]_v1_[a-f0-9]{64}",
        "gitleaks digitalocean-pat, -access-token, -refresh-token",
        right=WORD,
    ),
    SecretRule("databricks_token", r"dapi[a-f0-9]{32}(?:-[0-9])?", "gitleaks databricks-api-token", right=WORD),
    SecretRule("heroku_api_key", r"HRKU-AA[A-Za-z0-9_-]{58,}", "gitleaks heroku-api-key-v2", left=URLSAFE),
    SecretRule(
        "vault_token",
        r"hv[sbr]\.[A-Za-z0-9_-]{24,}",
        "gitleaks vault-service-token, vault-batch-token",
        left=URLSAFE_DOT,
    ),
    SecretRule(
        "terraform_token",
        r"[a-z0-9]{14}\.atlasv1\.[a-z0-9_=-]{60,}",
        "gitleaks hashicorp-tf-api-token",
        head=r"[a-z0-9]{14}\.atlasv1\.",
    ),
    SecretRule(
        "doppler_token",
        r"dp\.(?:pt|st|sa|ct|scim|audit)\.[A-Za-z0-9]{40,}",
        "gitleaks doppler-api-token",
        left=WORD + ".",
    ),
    # -- code hosting and package registries
    SecretRule(
        "github_token",
        r"gh[pousr]_[A-Za-z0-9]{36,}",
        "GitHub token formats (github.blog 2021-04-05: prefix + 30 base62 + CRC32 in 6 base62; the "
        "checksum is not verified, the prefix is unique); gitleaks github-pat, -oauth, -app-token",
    ),
    SecretRule(
        "github_fine_grained_pat",
        r"github_pat_[A-Za-z0-9_]{60,}",
        "gitleaks github-fine-grained-pat (github_pat_ + 22 + _ + 59)",
    ),
    SecretRule(
        "gitlab_token",
        r"(?:gl(?:pat|dt|rt|ptt|ft|soat|cbt|imt|agent|oas|ffct|wt)-|GR1348941)"
        r"[A-Za-z0-9_-]{20,}(?:\.[0-9a-z]{2}\.[0-9a-z]{9})?",
        "docs.gitlab.com token prefixes; gitleaks gitlab-pat, -ptt, -rrt, -deploy-token, ...",
        left=URLSAFE,
    ),
    SecretRule("npm_token", r"npm_[A-Za-z0-9]{36,}", "gitleaks npm-access-token; detect-secrets NpmDetector"),
    SecretRule(
        "pypi_token",
        r"pypi-AgEIcHlwaS5vcmc[A-Za-z0-9_-]{50,}",
        "gitleaks pypi-upload-token; detect-secrets PypiTokenDetector",
        left=URLSAFE,
    ),
    SecretRule("docker_hub_token", r"dckr_pat_[A-Za-z0-9_-]{27,}", "Docker Hub personal access token", left=URLSAFE),
    SecretRule(
        "atlassian_api_token", r"ATATT3[A-Za-z0-9_=-]{150,}", "gitleaks atlassian-api-token", left="A-Za-z0-9_=-"
    ),
    # -- messaging and SaaS
    SecretRule(
        "slack_webhook_url",
        r"(?:https?://)?hooks\.slack\.com/(?:services|workflows|triggers)/"
        r"[A-Za-z0-9_/+-]{20,}",
        "gitleaks slack-webhook-url; detect-secrets SlackDetector",
        left="A-Za-z0-9+./-",
    ),
    SecretRule(
        "discord_webhook_url",
        r"(?:https?://)?(?:[a-z]+\.)?discord(?:app)?\.com/api/webhooks/[0-9]{17,20}/"
        r"[A-Za-z0-9_-]{60,}",
        "detect-secrets DiscordBotTokenDetector's neighbour; Discord webhook URLs",
        left="A-Za-z0-9+./-",
    ),
    SecretRule(
        "slack_token",
        r"(?:xoxe\.)?xox[abposre]-[A-Za-z-]*[0-9][A-Za-z0-9-]*|xapp-[0-9]-[A-Za-z0-9-]{10,}",
        "gitleaks slack-bot-token, -user-token, -app-token, -config-access-token, -legacy-*; "
        "detect-secrets SlackDetector (a digit, 10 or more characters)",
        left=URLSAFE_DOT,
        check=lambda token: len(token) >= 15,
    ),
    SecretRule(
        "telegram_bot_token",
        r"[0-9]{8,10}:AA[A-Za-z0-9_-]{33}",
        "gitleaks telegram-bot-api-token; detect-secrets TelegramBotTokenDetector",
        right=URLSAFE,
        head="[0-9]{8,10}:AA",
    ),
    SecretRule(
        "stripe_key",
        r"(?:sk|rk)_(?:live|test|prod)_[A-Za-z0-9]{10,}|pk_live_[A-Za-z0-9]{10,}"
        r"|whsec_[A-Za-z0-9]{32,}",
        "gitleaks stripe-access-token; detect-secrets StripeDetector",
    ),
    SecretRule(
        "square_token",
        r"sq0(?:atp|csp)-[A-Za-z0-9_-]{22,}|EAAA[A-Za-z0-9_-]{60,}",
        "gitleaks square-access-token, square-secret; detect-secrets SquareOAuthDetector",
        left=URLSAFE,
    ),
    SecretRule(
        "shopify_token",
        r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}",
        "gitleaks shopify-access-token, -custom-access-token, -private-app-access-token, -shared-secret",
        right=WORD,
    ),
    SecretRule(
        "sendgrid_api_key",
        r"SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}",
        "gitleaks sendgrid-api-token; detect-secrets SendGridDetector",
        left=URLSAFE_DOT,
        right=URLSAFE,
    ),
    SecretRule(
        "twilio_api_key", r"SK[0-9a-fA-F]{32}", "gitleaks twilio-api-key; detect-secrets TwilioKeyDetector", right=WORD
    ),
    SecretRule(
        "mailgun_api_key",
        r"key-[0-9a-f]{32}",
        "gitleaks mailgun-private-api-token; detect-secrets MailchimpDetector's neighbour",
        left=URLSAFE,
        right=WORD,
    ),
    SecretRule(
        "mailchimp_api_key",
        r"[0-9a-f]{32}-us[0-9]{1,2}",
        "gitleaks mailchimp-api-key; detect-secrets MailchimpDetector",
        right=WORD,
    ),
    SecretRule("linear_api_key", r"lin_api_[A-Za-z0-9]{40,}", "gitleaks linear-api-key"),
    SecretRule("notion_token", r"ntn_[0-9]{11}[A-Za-z0-9]{32,}", "Notion integration token (ntn_)"),
    SecretRule(
        "postman_api_key",
        r"PMAK-[a-fA-F0-9]{24}-[a-fA-F0-9]{34}",
        "gitleaks postman-api-token",
        left=URLSAFE,
        right=WORD,
    ),
    SecretRule(
        "newrelic_api_key",
        r"NR(?:AK|II)-[A-Za-z0-9_-]{27,}",
        "gitleaks new-relic-user-api-key, new-relic-insert-key",
        left=URLSAFE,
    ),
    SecretRule(
        "grafana_token",
        r"glsa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}|glc_[A-Za-z0-9+/]{32,}={0,2}",
        "gitleaks grafana-service-account-token, grafana-cloud-api-token",
        left=WORD + "+/=",
    ),
    SecretRule(
        "age_secret_key",
        r"AGE-SECRET-KEY-1[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}",
        "gitleaks age-secret-key",
        left=URLSAFE,
        right=WORD,
    ),
    SecretRule(
        "jwt",
        r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
        "gitleaks jwt; detect-secrets JwtTokenDetector (header, payload, signature; the signature may "
        "be empty for alg none: not covered)",
        left=URLSAFE_DOT,
    ),
    # -- credentials by context
    SecretRule(
        "url_credentials",
        r"[A-Za-z][A-Za-z0-9+.-]{1,30}://[^ \t\r\n\"'<>/:@\\]{0,128}:"
        r"(?P<secret>[^ \t\r\n\"'<>/@\\]{1,256})@",
        "gitleaks generic URL credentials; detect-secrets BasicAuthDetector (scheme://user:password@host)",
        left="A-Za-z0-9+.-",
        head=r"[A-Za-z][A-Za-z0-9+.-]*://",
        collector=r"[A-Za-z][A-Za-z0-9+.-]{1,30}://[^ \"'<>/:@\\]{0,128}:(?P<secret>[^ \"'<>/@\\]{1,256})@",
    ),
    SecretRule(
        "authorization_header",
        r"(?i:(?:proxy-)?authorization)[\"']?[ \t]*[:=][ \t]*[\"']?"
        r"(?:(?i:bearer|basic|token|apikey|api-key|key|digest)[ \t]+)?(?P<secret>[A-Za-z0-9._~+/=-]{8,})",
        "HTTP Authorization header, any scheme (RFC 9110 11.6.2; detect-secrets BasicAuthDetector)",
        collector=r"(?i:(?:proxy-)?authorization)(?:\\\"|')?[ ]*[:=][ ]*(?:\\\"|')?"
        r"(?:(?i:bearer|basic|token|apikey|api-key|key|digest)[ ]+)?(?P<secret>[A-Za-z0-9._~+/=-]{8,})",
    ),
    SecretRule(
        "bearer_token",
        r"(?i:bearer)[ \t]+(?P<secret>[A-Za-z._~+/=-]*(?:[0-9]|[A-Za-z0-9._~+/=-][A-Z])"
        r"[A-Za-z0-9._~+/=-]*)",
        "RFC 6750 bearer token after the word Bearer; a digit or an inner capital (prose is not a token)",
        check=lambda token: len(token) >= 8,
        collector=r"(?i:bearer)[ ]+(?P<secret>[A-Za-z._~+/=-]*(?:[0-9]|[A-Za-z0-9._~+/=-][A-Z])"
        r"[A-Za-z0-9._~+/=-]*)",
    ),
    SecretRule(
        "password_assignment",
        _NAME.format(PASSWORD_NAMES) + _SEP + f"(?P<secret>{_VALUE})",
        "gitleaks generic-api-key / detect-secrets KeywordDetector: a password-like name (password, "
        "passwd, passphrase, pwd) assigned a literal of 4+ characters, whatever its entropy",
        left=WORD + ".-",
        check=password_value,
        collector=_NAME.format(PASSWORD_NAMES) + _SEP_JSON + f"(?P<secret>{_VALUE_JSON})",
    ),
    _flag_rule(
        "password_assignment",
        PASSWORD_NAMES,
        _VALUE,
        _VALUE_JSON,
        password_value,
        "the same as a command-line flag: --password value, --db-password=value",
    ),
    _xml_rule(
        "password_assignment",
        PASSWORD_NAMES,
        4,
        password_value,
        "the same in XML (Maven settings.xml, ...): <password>value</password>",
    ),
    _flag_rule(
        "secret_assignment",
        SECRET_NAMES,
        _VALUE8,
        _FIRST_JSON + r"[^ \"'`,;{}\\)\]<>]{7,}",
        secret_value,
        "the same as a command-line flag: --api-key value, --token=value",
    ),
    _xml_rule("secret_assignment", SECRET_NAMES, 8, secret_value, "the same in XML: <secret>value</secret>"),
    SecretRule(
        "secret_assignment",
        _NAME.format(SECRET_NAMES) + _SEP + f"(?P<secret>{_VALUE8})",
        "gitleaks generic-api-key / detect-secrets KeywordDetector: a secret-looking name (secret, token, "
        "api_key, access_key, private_key, credentials, ...) assigned a literal of 8+ characters from two "
        "classes with 3+ bits of entropy per character",
        left=WORD + ".-",
        check=secret_value,
        collector=_NAME.format(SECRET_NAMES) + _SEP_JSON + "(?P<secret>" + _FIRST_JSON + r"[^ \"'`,;{}\\)\]<>]{7,})",
    ),
)

# rules that find a secret by what stands next to it: when the secret is one of the formats, it is
# counted under the format's name
REFINED = ("url_credentials", "authorization_header", "bearer_token", "password_assignment", "secret_assignment")
# rules recognised by their own shape (not by a name or header next to them): an assignment whose value
# is one of these is counted under this rule's name
SPECIFIC = frozenset(r.name for r in RULES) - {
    "url_credentials",
    "authorization_header",
    "bearer_token",
    "password_assignment",
    "secret_assignment",
    "azure_storage_account_key",
}


# ---- the collector's form -----------------------------------------------------------------------

COLLECTOR_BOUNDARY = r"(\\[\\nrtbf]|^|[^\\{}])"


def _split_secret(pattern: str) -> tuple[str, str, str]:
    """(kept before, secret, kept after) of a pattern with a (?P<secret>...) group; ("", pattern, "")
    without one."""
    start = pattern.find("(?P<secret>")
    if start < 0:
        return "", pattern, ""
    end = next((i for i, _, depth in scan(pattern, start) if depth == 0), len(pattern))
    return pattern[:start], pattern[start + len("(?P<secret>") : end], pattern[end + 1 :]


def scan(pattern: str, start: int = 0):
    """(index, character, group depth after it) of each character of an RE2 pattern from `start`,
    escapes and character classes skipped."""
    depth, i = 0, start
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = class_end(pattern, i)
            continue
        depth += (c == "(") - (c == ")")
        yield i, c, depth
        i += 1


def class_end(pattern: str, i: int) -> int:
    """The index after the character class that starts at pattern[i] (`[`)."""
    i += 1 + (pattern[i + 1 : i + 2] == "^")
    i += pattern[i : i + 1] == "]"
    while pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def collector_regex() -> tuple[str, str]:
    """(regex, replacement) of the collector's secret statement: the rows grouped by their `left`
    class, each group `(boundary)(?:(kept before)secret(kept after)|...)`, the replacement keeping
    the boundary and the kept parts. One boundary per group keeps Go's regexp from starting a thread
    for every row at every position. Leftmost-first, as on the servers (rows with the same left class
    in table order); no checks. The boundary group is the existing statements': a JSON escape
    (\\n, \\t, ...), the start, or a character outside the row's `left` and not a backslash."""
    by_left: dict[str, list[SecretRule]] = {}
    for rule in RULES:
        by_left.setdefault(rule.left, []).append(rule)
    alternatives, before, after = [], [], []
    group = 0
    for left, rules in by_left.items():
        group += 1
        before.append(group)
        inner = []
        for rule in rules:
            kept, secret, tail = _split_secret(rule.collector or rule.pattern)
            # no character after a match is consumed (it could be the backslash of the JSON escape that
            # is the next match's boundary): a word boundary where the rule asks for one, else nothing
            # (a fixed-length format followed by more of its alphabet loses its first part: more, not less)
            right = r"\b" if rule.right == WORD else ""
            inner.append(f"({kept})(?:{secret}){right}({tail})")
            before.append(group + 1)
            after.append(group + 2)
            group += 2
        alternatives.append(f"{COLLECTOR_BOUNDARY.format(left)}(?:{'|'.join(inner)})")
    repl = "".join(f"${{{g}}}" for g in before) + "<SECRET>" + "".join(f"${{{g}}}" for g in after)
    return "|".join(alternatives), repl


def collector_statement(attribute: str) -> str:
    """The OTTL statement of transform/content_redaction that redacts the secrets of one content
    attribute, as it stands in the collector's YAML (OTTL string escapes, `$$` for the collector's
    `$` unescaping)."""
    regex, replacement = collector_regex()

    def literal(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    statement = f"replace_pattern(span.attributes[{literal(attribute)}], {literal(regex)}, {literal(replacement)})"
    return statement.replace("$", "$$")


def rewrite_collector_config(path: str, attributes: tuple[str, ...]) -> bool:
    """Replaces the secret statements (those with <SECRET>) of transform/content_redaction in a
    collector YAML file by the table's, one per attribute where its first one stood. True if changed."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, done = [], set()
    for line in lines:
        if "<SECRET>" in line and "replace_pattern(span.attributes[" in line:
            attribute = next(a for a in attributes if f'span.attributes["{a}"]' in line)
            if attribute not in done:
                indent = line[: len(line) - len(line.lstrip())]
                out.append(indent + "- '" + collector_statement(attribute).replace("'", "''") + "'")
                done.add(attribute)
            continue
        out.append(line)
    text = "\n".join(out)
    with open(path, encoding="utf-8") as f:
        changed = f.read() != text
    if changed:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return changed


# python -m otel_llm.secret_rules collector-config/otelcol.yaml collector-config/sampler.yaml
if __name__ == "__main__":
    import sys

    from otel_llm import semconv

    for name in sys.argv[1:]:
        content = (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES, semconv.GEN_AI_SYSTEM_INSTRUCTIONS)
        print(name, "rewritten" if rewrite_collector_config(name, content) else "unchanged")

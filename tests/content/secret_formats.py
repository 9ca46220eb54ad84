"""Random secrets of every format the built-in secret rules cover, look-alikes that must survive,
and the ways a secret sits in captured text. Used by content/test_secret_properties.py (the servers'
redactor and the collector's second line) and by end-to-end tests.

FORMATS: format name -> one random valid secret of that format (the provider's documented prefix,
alphabet and length range; checksums computed where the format has one). The whole string is the
secret: none of it may survive redaction.
CONTEXTUAL: name -> (text, secret): secrets recognised only by what stands next to them (a variable
name, `Authorization: Basic`, a URL's user part); the text keeps its context, the secret goes.
NEGATIVES: look-alike name -> one text that must survive redaction unchanged.
EMBEDDINGS: ways to put a secret (or a CONTEXTUAL text) into a prompt.
WORST_CASES: long near misses of the rules, the slowest kinds of text for the redactor.
"""

from __future__ import annotations

import base64
import json
import random
import string
import uuid
import zlib
from collections.abc import Callable

B62 = string.ascii_letters + string.digits
URLSAFE = B62 + "-_"
B64 = B62 + "+/"
HEX = "0123456789abcdef"
HEX_MIXED = HEX + "ABCDEF"
UPPER_DIGITS = string.ascii_uppercase + string.digits
BASE32 = string.ascii_uppercase + "234567"
BECH32 = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
GITHUB_BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase


def _s(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _base62(n: int, width: int) -> str:
    out = ""
    while n:
        n, r = divmod(n, 62)
        out = GITHUB_BASE62[r] + out
    return out.rjust(width, "0")


def _github(rng: random.Random) -> str:
    """ghp_/gho_/ghu_/ghs_/ghr_ + 30 base62 + CRC32 of those 30 in 6 base62 digits (GitHub's 2021 format)."""
    body = _s(rng, B62, 30)
    return rng.choice(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"]) + body + _base62(zlib.crc32(body.encode()), 6)


def _openai(prefix: str) -> Callable[[random.Random], str]:
    def make(rng: random.Random) -> str:
        n = rng.choice([58, 74])  # the two body lengths around the T3BlbkFJ marker (gitleaks openai-api-key)
        return prefix + _s(rng, URLSAFE, n) + "T3BlbkFJ" + _s(rng, URLSAFE, n)

    return make


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _jwt(rng: random.Random) -> str:
    header = {"alg": rng.choice(["HS256", "RS256", "ES256", "EdDSA"]), "typ": "JWT"}
    if rng.random() < 0.5:
        header["kid"] = _s(rng, B62, rng.randint(4, 20))
    payload = {"sub": _s(rng, B62, rng.randint(1, 24)), "iat": rng.randint(10**9, 2 * 10**9)}
    if rng.random() < 0.5:
        payload["name"] = rng.choice(["Jane Doe", "张伟", "svc-batch", "o'brien"])
    sig = _s(rng, URLSAFE, rng.choice([43, 86, 342]))
    return f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(payload).encode())}.{sig}"


PEM_KINDS = (
    "RSA PRIVATE KEY",
    "PRIVATE KEY",
    "EC PRIVATE KEY",
    "OPENSSH PRIVATE KEY",
    "ENCRYPTED PRIVATE KEY",
    "DSA PRIVATE KEY",
    "PGP PRIVATE KEY BLOCK",
)


def _pem(newline: str) -> Callable[[random.Random], str]:
    def make(rng: random.Random) -> str:
        kind = rng.choice(PEM_KINDS)
        body = base64.b64encode(rng.randbytes(rng.randint(90, 1300))).decode()
        width = 70 if "OPENSSH" in kind else 64
        lines = [body[i : i + width] for i in range(0, len(body), width)]
        if kind == "RSA PRIVATE KEY" and rng.random() < 0.3:
            lines = [
                "Proc-Type: 4,ENCRYPTED",
                "DEK-Info: AES-128-CBC," + _s(rng, HEX_MIXED[6:] + "0123456789", 32),
                "",
                *lines,
            ]
        if kind == "PGP PRIVATE KEY BLOCK":
            lines = ["Version: GnuPG v2", "", *lines, "=" + _s(rng, B64, 4)]
        return newline.join([f"-----BEGIN {kind}-----", *lines, f"-----END {kind}-----"])

    return make


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return str(rng.randint(1, 9)) + _s(rng, string.digits, rng.randint(lo, hi) - 1)


FORMATS: dict[str, Callable[[random.Random], str]] = {
    # OpenAI (platform.openai.com key formats; gitleaks openai-api-key)
    "openai_project_key": _openai("sk-proj-"),
    "openai_service_account_key": _openai("sk-svcacct-"),
    "openai_admin_key": _openai("sk-admin-"),
    "openai_legacy_key": lambda rng: "sk-" + _s(rng, B62, 20) + "T3BlbkFJ" + _s(rng, B62, 20),
    # OpenAI-compatible providers' sk- keys: OpenRouter, DeepSeek
    "openrouter_key": lambda rng: "sk-or-v1-" + _s(rng, HEX, 64),
    "deepseek_key": lambda rng: "sk-" + _s(rng, HEX, 32),
    # Anthropic (gitleaks anthropic-api-key / anthropic-admin-api-key)
    "anthropic_api_key": lambda rng: "sk-ant-api03-" + _s(rng, URLSAFE, 93) + "AA",
    "anthropic_admin_key": lambda rng: "sk-ant-admin01-" + _s(rng, URLSAFE, 93) + "AA",
    # AWS access key ID (gitleaks aws-access-token)
    "aws_access_key_id": lambda rng: rng.choice(["AKIA", "ASIA", "ABIA", "ACCA"]) + _s(rng, BASE32, 16),
    # GitHub (github.blog 2021-04-05 "Behind GitHub's new authentication token formats")
    "github_token": _github,
    "github_fine_grained_pat": lambda rng: "github_pat_" + _s(rng, B62, 22) + "_" + _s(rng, B62, 59),
    # GitLab (docs.gitlab.com/security/tokens: token prefixes)
    "gitlab_token": lambda rng: (
        rng.choice(["glpat-", "gldt-", "glrt-", "glptt-", "glft-", "glsoat-", "glcbt-"]) + _s(rng, URLSAFE, 20)
    ),
    # Slack (api.slack.com/authentication/token-types; gitleaks slack-*)
    "slack_bot_token": lambda rng: "xoxb-" + _digits(rng, 10, 13) + "-" + _digits(rng, 10, 13) + "-" + _s(rng, B62, 24),
    "slack_user_token": lambda rng: (
        rng.choice(["xoxp-", "xoxe-"]) + "-".join(_digits(rng, 10, 13) for _ in range(3)) + "-" + _s(rng, HEX, 32)
    ),
    "slack_app_token": lambda rng: (
        "xapp-1-A" + _s(rng, UPPER_DIGITS, 10) + "-" + _digits(rng, 13, 13) + "-" + _s(rng, HEX, 64)
    ),
    "slack_webhook_url": lambda rng: (
        "https://hooks.slack.com/services/T"
        + _s(rng, UPPER_DIGITS, rng.randint(8, 10))
        + "/B"
        + _s(rng, UPPER_DIGITS, rng.randint(8, 10))
        + "/"
        + _s(rng, B62, 24)
    ),
    "discord_webhook_url": lambda rng: (
        "https://discord.com/api/webhooks/" + _digits(rng, 17, 19) + "/" + _s(rng, URLSAFE, 68)
    ),
    # Stripe (docs.stripe.com/keys; gitleaks stripe-access-token)
    "stripe_key": lambda rng: (
        rng.choice(["sk_live_", "sk_test_", "rk_live_", "rk_test_", "pk_live_"]) + _s(rng, B62, rng.randint(24, 99))
    ),
    # Google (gitleaks gcp-api-key; OAuth client secret and access token)
    "google_api_key": lambda rng: "AIza" + _s(rng, URLSAFE, 35),
    "google_oauth_client_secret": lambda rng: "GOCSPX-" + _s(rng, URLSAFE, 28),
    "google_oauth_access_token": lambda rng: "ya29." + _s(rng, URLSAFE, rng.randint(60, 200)),
    # private keys (PEM, RFC 7468; OpenSSH; PGP armor), also as a JSON string (GCP service-account file)
    "private_key_pem": _pem("\n"),
    "private_key_pem_json_escaped": _pem("\\n"),
    "jwt": _jwt,
    # AI platforms
    "huggingface_token": lambda rng: rng.choice(["hf_", "api_org_"]) + _s(rng, string.ascii_letters, 34),
    "groq_key": lambda rng: "gsk_" + _s(rng, B62, 52),
    "replicate_token": lambda rng: "r8_" + _s(rng, B62, 37),
    "perplexity_key": lambda rng: "pplx-" + _s(rng, B62, 48),
    "xai_key": lambda rng: "xai-" + _s(rng, B62, 80),
    "langsmith_key": lambda rng: rng.choice(["lsv2_pt_", "lsv2_sk_"]) + _s(rng, HEX, 32) + "_" + _s(rng, HEX, 10),
    # package registries
    "npm_token": lambda rng: "npm_" + _s(rng, B62, 36),
    "pypi_token": lambda rng: "pypi-AgEIcHlwaS5vcmc" + _s(rng, URLSAFE, rng.randint(50, 200)),
    "docker_hub_pat": lambda rng: "dckr_pat_" + _s(rng, URLSAFE, 27),
    # other high-volume providers (gitleaks rule ids in otel_llm/secret_rules.py)
    "twilio_api_key": lambda rng: "SK" + _s(rng, HEX, 32),
    "sendgrid_api_key": lambda rng: "SG." + _s(rng, URLSAFE, 22) + "." + _s(rng, URLSAFE, 43),
    "mailgun_key": lambda rng: "key-" + _s(rng, HEX, 32),
    "mailchimp_key": lambda rng: _s(rng, HEX, 32) + "-us" + str(rng.randint(1, 21)),
    "databricks_token": lambda rng: "dapi" + _s(rng, HEX, 32) + rng.choice(["", "-2"]),
    "shopify_token": lambda rng: rng.choice(["shpat_", "shpca_", "shppa_", "shpss_"]) + _s(rng, HEX_MIXED, 32),
    "digitalocean_token": lambda rng: rng.choice(["dop_v1_", "doo_v1_", "dor_v1_"]) + _s(rng, HEX, 64),
    "square_token": lambda rng: rng.choice(
        [
            lambda: "sq0atp-" + _s(rng, URLSAFE, 22),
            lambda: "sq0csp-" + _s(rng, URLSAFE, 43),
            lambda: "EAAA" + _s(rng, URLSAFE, 60),
        ]
    )(),
    "heroku_key": lambda rng: "HRKU-AA" + _s(rng, URLSAFE, 58),
    "atlassian_token": lambda rng: "ATATT3" + _s(rng, URLSAFE, 186),
    "linear_key": lambda rng: "lin_api_" + _s(rng, B62, 40),
    "notion_token": lambda rng: "ntn_" + _s(rng, string.digits, 11) + _s(rng, B62, 35),
    "doppler_token": lambda rng: rng.choice(["dp.pt.", "dp.st.", "dp.sa.", "dp.ct."]) + _s(rng, B62, 43),
    "postman_key": lambda rng: "PMAK-" + _s(rng, HEX, 24) + "-" + _s(rng, HEX, 34),
    "newrelic_key": lambda rng: rng.choice(["NRAK-", "NRII-"]) + _s(rng, UPPER_DIGITS, 27),
    "grafana_token": lambda rng: rng.choice(
        [
            lambda: "glsa_" + _s(rng, B62, 32) + "_" + _s(rng, HEX, 8),
            lambda: "glc_" + _s(rng, B64, rng.randint(32, 120)) + rng.choice(["", "=", "=="]),
        ]
    )(),
    "vault_token": lambda rng: rng.choice(["hvs.", "hvb."]) + _s(rng, URLSAFE, rng.randint(90, 120)),
    "terraform_token": lambda rng: (
        _s(rng, string.ascii_lowercase + string.digits, 14)
        + ".atlasv1."
        + _s(rng, string.ascii_lowercase + string.digits + "-_=", 67)
    ),
    "age_secret_key": lambda rng: "AGE-SECRET-KEY-1" + _s(rng, BECH32, 58).upper(),
    "telegram_bot_token": lambda rng: _digits(rng, 8, 10) + ":AA" + _s(rng, URLSAFE, 33),
    "azure_ad_client_secret": lambda rng: (
        _s(rng, B62 + "_~.", 3) + rng.choice(string.digits) + "Q~" + _s(rng, B62 + "_~.-", 34)
    ),
}


def _assignment(rng: random.Random) -> tuple[str, str]:
    """A secret-looking name assigned a random high-entropy value, as in code, config and .env files."""
    name = rng.choice(
        [
            "password",
            "PASSWORD",
            "db_password",
            "passwd",
            "pwd",
            "secret",
            "client_secret",
            "SECRET_KEY",
            "api_key",
            "apiKey",
            "API_KEY",
            "x-api-key",
            "access_token",
            "auth_token",
            "token",
            "private_key",
            "aws_secret_access_key",
            "secret_access_key",
            "passphrase",
            "credentials",
            "app_secret",
            "encryption_key",
            "signing_key",
        ]
    )
    value = _s(rng, B62 + "!#%*+-./:@^_~", rng.randint(12, 64))
    form = rng.choice(
        [
            "{name}={value}",
            '{name} = "{value}"',
            "{name}: '{value}'",
            '"{name}": "{value}"',
            "{name}: {value}",
            'export {name}="{value}"',
            '{name} := "{value}"',
            "'{name}' => '{value}'",
            "<{name}>{value}</{name}>",
            '--{name} "{value}"',
            '{name}="{value}"',
        ]
    )
    return form.format(name=name, value=value), value


def _url_credentials(rng: random.Random) -> tuple[str, str]:
    password = _s(rng, B62 + "-._~!$&*+,;=%", rng.randint(6, 40))
    scheme = rng.choice(["postgres", "postgresql", "mysql", "mongodb+srv", "redis", "amqp", "https", "ftp", "smtp"])
    user = rng.choice(["admin", "app_user", "", "u-1.x", "ro"])
    host = rng.choice(["db.internal", "10.0.0.5:5432", "cluster0.ab1cd.mongodb.net", "localhost"])
    return f"{scheme}://{user}:{password}@{host}/app?sslmode=require", password


def _basic(rng: random.Random) -> tuple[str, str]:
    cred = base64.b64encode(f"{_s(rng, B62, rng.randint(3, 12))}:{_s(rng, B64, rng.randint(8, 40))}".encode()).decode()
    return rng.choice(
        [
            "Authorization: Basic {c}",
            "authorization: basic {c}",
            '"Authorization": "Basic {c}"',
            "-H 'Authorization: Basic {c}'",
        ]
    ).format(c=cred), cred


def _bearer(rng: random.Random) -> tuple[str, str]:
    token = rng.choice([_s(rng, B62 + "-._~+/", rng.randint(20, 80)), _jwt(rng)])
    return rng.choice(
        ["Authorization: Bearer {t}", "authorization: bearer {t}", "Bearer {t}", "Authorization: Token {t}"]
    ).format(t=token), token


def _aws_secret(rng: random.Random) -> tuple[str, str]:
    secret = _s(rng, B64, 40)
    key_id = FORMATS["aws_access_key_id"](rng)
    form = rng.choice(
        [
            "aws_secret_access_key = {s}",
            "AWS_SECRET_ACCESS_KEY={s}",
            '"SecretAccessKey": "{s}"',
            "aws_access_key_id={k}\naws_secret_access_key={s}",
            "{k} {s}",
            "{k}:{s}",
            "{k},{s}",
        ]
    )
    return form.format(s=secret, k=key_id), secret


def _azure_storage(rng: random.Random) -> tuple[str, str]:
    key = base64.b64encode(rng.randbytes(64)).decode()
    return (
        f"DefaultEndpointsProtocol=https;AccountName=acct{rng.randint(1, 999)};AccountKey={key};"
        "EndpointSuffix=core.windows.net"
    ), key


CONTEXTUAL: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "secret_assignment": _assignment,
    "url_credentials": _url_credentials,
    "basic_auth": _basic,
    "bearer_token": _bearer,
    "aws_secret_access_key": _aws_secret,
    "azure_storage_account_key": _azure_storage,
}


def _words(rng: random.Random, n: int) -> str:
    vocab = (
        "the model token is expired request latency cache queue skip learn use bearer authentication key "
        "secret password reset policy rotate api server client batch prompt"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(n))


_CJK = "请使用密钥令牌过期模型推理缓存队列的一是在不了有和人这中大为上个国"

NEGATIVES: dict[str, Callable[[random.Random], str]] = {
    "prose": lambda rng: _words(rng, rng.randint(5, 40)),
    "bearer_prose": lambda rng: rng.choice(
        [
            "Use Bearer authentication for the API.",
            "Bearer tokens expire hourly",
            "the bearer of bad news",
            "Authorization: Bearer <token>",
            "Authorization: Bearer $TOKEN",
            "set the Bearer Authentication header",
            "Authorization: Basic <base64 of user:password>",
        ]
    ),
    "token_prose": lambda rng: rng.choice(
        [
            "the token is expired",
            "max_tokens: 1024",
            '"max_tokens": 256',
            "password reset link sent",
            'api_key = os.environ["OPENAI_API_KEY"]',
            "token = get_token()",
            "password: ${DB_PASSWORD}",
            "secret=None",
            "api_key: <your-api-key>",
            "password = ''",
            "token: null",
            "password=$PASSWORD",
            "secret_key = settings.SECRET_KEY",
            "the token_count is 12",
            "password is required",
        ]
    ),
    "sklearn_words": lambda rng: rng.choice(
        [
            "sk-learn",
            "sk-learn-compatible-estimators-and-pipelines",
            "task-management-dashboard-overview",
            "risk-assessment-framework-v2",
            "desk-booking",
            "pk-fk-constraints-in-postgres",
        ]
    ),
    "sha1_hex": lambda rng: "commit " + _s(rng, HEX, 40),
    "sha256_hex": lambda rng: "sha256:" + _s(rng, HEX, 64),
    "md5_hex": lambda rng: _s(rng, HEX, 32) + "  model.bin",
    "git_sha_short": lambda rng: "fixed in " + _s(rng, HEX, rng.randint(7, 12)),
    "uuid": lambda rng: "request " + str(uuid.UUID(int=rng.getrandbits(128), version=4)),
    "base64_image": lambda rng: (
        "![img](data:image/png;base64,"
        + base64.b64encode(b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randint(60, 1500))).decode()
        + ")"
    ),
    "url_without_credentials": lambda rng: rng.choice(
        [
            "https://example.com/docs?page=2&sort=asc",
            "postgres://db.internal:5432/app",
            "redis://localhost:6379/0",
            "https://github.com/org/repo.git",
            "http://localhost:8080/health",
            "https://hooks.slack.com/services/",
            "https://discord.com/api/webhooks/",
        ]
    ),
    "identifiers": lambda rng: rng.choice(
        [
            "sklearn.linear_model.LogisticRegression",
            "AKIA is the prefix",
            "ghp_ tokens",
            "xoxb- bot tokens",
            "my_secret_function()",
            "SECRET_KEY_BASE",
            "github_pat_ prefix",
            "-----BEGIN CERTIFICATE-----",
            "Llama-3.1-8B-Instruct",
            "meta-llama/Llama-3.1-8B-Instruct",
            "Qwen2.5-72B-Instruct-AWQ",
            "AIzaSy is Google's prefix",
        ]
    ),
    "cjk_prose": lambda rng: "".join(rng.choice(_CJK) for _ in range(rng.randint(5, 60))),
}


EMBEDDINGS: tuple[Callable[[str], str], ...] = (  # the first PLAIN ones put nothing secret-looking before it
    lambda s: s,  # the whole text
    lambda s: f"my key is {s} thanks",  # in a sentence
    lambda s: f"{s} is the key",  # at the start of the text
    lambda s: f"the key: {s}",  # at the end of the text
    lambda s: f'"{s}"',  # double quotes
    lambda s: f"key='{s}'",  # single quotes
    lambda s: f"`{s}`",  # markdown inline code
    lambda s: f"密钥{s}结束",  # next to CJK characters, no spaces
    lambda s: f"（{s}）。",  # full-width punctuation
    lambda s: f"<key>{s}</key>",  # XML
    lambda s: f"- {s}\n- done",  # a list item
    lambda s: f"```\n{s}\n```",  # markdown code fence
    lambda s: f"OPENAI_API_KEY={s}",  # KEY=
    lambda s: json.dumps({"api_key": s, "model": "gpt"}),  # a JSON value
    lambda s: f"# .env\nAPI_TOKEN={s}\nDEBUG=1\n",  # an .env line
    lambda s: f"```bash\nexport TOKEN={s}\n```",  # markdown code fence, shell
)
PLAIN = 12  # EMBEDDINGS[:PLAIN] add no name or header of their own (for the CONTEXTUAL texts, which have one)

# near misses of the redactor's rules, long (about 7,000 tokens together): a prompt of them goes
# through the real server in e2e/test_secret_leaks_e2e.py, and its time per KB is bounded in
# content/test_redaction_time.py
WORST_CASES = (
    "sk-" + "a-" * 400,
    "Bearer " * 100,
    "eyJ" + "a" * 400 + "." + "b" * 400,
    "AKIA" * 150,
    "4111 " * 150,
    "1." * 400,
    "a:" * 400,
    "x" * 600 + "@",
    "xox" * 200,
    "_" * 600,
    "-" * 600,
)

"""Attribution below the tenant on the real vLLM CPU server: two API keys of one tenant in
OTEL_LLM_API_KEYS_FILE (one with an id, one with the default id), and end users named by the OpenAI
`user` field or its newer `safety_identifier`. `otel-llm report --ledger --by api_key,user` must tell
them apart, to the token of each response's usage; the GenAI spans and the OTLP usage events carry
them, no metric point does; and neither key, nor its SHA-256, is in any byte that left (OTLP traces,
metrics and logs, the usage spool, the server's output)."""

import argparse
import hashlib
import io
import json
import secrets
import time
from collections import Counter

import openai
import pytest
from helpers import genai_spans, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger, report
from otel_llm.vllm.attribution import KEY_ID_LENGTH

PROD_KEY = f"sk-prod-{secrets.token_hex(16)}"
BATCH_KEY = f"sk-batch-{secrets.token_hex(16)}"
OTHER_KEY = f"sk-other-{secrets.token_hex(16)}"  # not in the key map
PROD_ID = "acme-prod"
BATCH_ID = hashlib.sha256(BATCH_KEY.encode()).hexdigest()[:KEY_ID_LENGTH]  # no id in its entry
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory, spool):
    keys = tmp_path_factory.mktemp("keys") / "api-keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {
                        "sha256": hashlib.sha256(PROD_KEY.encode()).hexdigest(),
                        "tenant": "acme",
                        "scene": "prod",
                        "id": PROD_ID,
                    },
                    {"sha256": hashlib.sha256(BATCH_KEY.encode()).hexdigest(), "tenant": "acme", "scene": "batch"},
                ]
            }
        )
    )
    srv = start_server(
        receiver,
        tmp_path_factory,
        "attribution",
        env={
            "OTEL_LLM_API_KEYS_FILE": str(keys),
            "OTEL_LLM_USAGE_DIR": str(spool),
            "OTEL_LLM_USAGE_EVENTS": "true",
            "OTEL_LOGS_EXPORTER": "otlp",
        },
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def traffic(vllm):
    """Calls of two keys of tenant acme for three end users, and of a key the map lacks; returns the
    usage each (key id, user) got in its responses, and the window they were sent in."""
    started = time.time()
    client = {
        key: openai.OpenAI(base_url=vllm.url + "/v1", api_key=key, max_retries=0)
        for key in (PROD_KEY, BATCH_KEY, OTHER_KEY)
    }
    used = Counter()
    requests = Counter()

    def book(key_id, user, usage):
        used[(key_id, user, semconv.TOKEN_TYPE_INPUT)] += usage.prompt_tokens
        used[(key_id, user, semconv.TOKEN_TYPE_OUTPUT)] += usage.completion_tokens
        requests[(key_id, user)] += 1

    for _ in range(2):
        book(
            PROD_ID,
            "alice",
            client[PROD_KEY].chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, user="alice").usage,
        )
    chunks = list(
        client[PROD_KEY].chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=6,
            user="bob",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    book(PROD_ID, "bob", chunks[-1].usage)
    book(
        BATCH_ID,
        "alice",
        client[BATCH_KEY].completions.create(model=MODEL_NAME, prompt="a batch job", max_tokens=7, user="alice").usage,
    )
    # safety_identifier (OpenAI's replacement of `user`) wins over user
    book(
        BATCH_ID,
        "hash-c4f1",
        client[BATCH_KEY]
        .chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=3, user="ignored", extra_body={"safety_identifier": "hash-c4f1"}
        )
        .usage,
    )
    # an unmapped key: tenant from the header, no key id; a user over the length cap is not recorded
    book(
        "-",
        "-",
        client[OTHER_KEY]
        .chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=4, user="u" * 500, extra_headers={"x-tenant-id": "beta"}
        )
        .usage,
    )
    return used, requests, started, sum(requests.values())


@pytest.fixture(scope="module")
def delivered(traffic, vllm, receiver, spool):
    """Every request's GenAI span and usage event arrived, and its spool record was written."""
    count = traffic[3]
    receiver.wait_for(
        lambda rx: (
            len([s for s in genai_spans(rx.spans) if s.scope == "otel_llm.vllm"]) >= count
            and len([r for r in rx.logs if r.event_name == semconv.USAGE_EVENT]) >= count
            or None
        ),
        timeout=60,
    )
    deadline = time.monotonic() + 30
    while len(ledger.read_spool(str(spool))) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(ledger.read_spool(str(spool))) == count


def run_report(spool, started, *argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["--ledger", str(spool), "--start", str(int(started) - 60), "--format", "json", *argv])
    code = report.run(args, now=time.time() + 5, out=out, err=err)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_the_report_tells_keys_and_users_apart(traffic, delivered, spool):
    used, requests, started, _ = traffic
    data = run_report(spool, started, "--by", "tenant,api_key,user")
    got = {
        (r["tenant"], r["api_key"], r["user"]): (r["tokens"]["input"], r["tokens"]["output"], r["requests"])
        for r in data["rows"]
    }
    expected = {
        ("beta" if key_id == "-" else "acme", key_id, user): (
            used[(key_id, user, semconv.TOKEN_TYPE_INPUT)],
            used[(key_id, user, semconv.TOKEN_TYPE_OUTPUT)],
            n,
        )
        for (key_id, user), n in requests.items()
    }
    assert got == expected
    assert len({k[1] for k in got}) == 3 and len({k[2] for k in got}) == 4  # keys and users really differ
    # the top consumer of tenant acme's keys, by tokens
    top = run_report(spool, started, "--by", "api_key", "--top", "1")["rows"]

    def tokens_of(key_id):
        return sum(n for (k, _, t), n in used.items() if k == key_id and t != semconv.TOKEN_TYPE_CACHED_INPUT)

    leader = max((PROD_ID, BATCH_ID, "-"), key=tokens_of)
    assert [r["api_key"] for r in top] == [leader, "(2 others)"]
    assert top[0]["tokens"]["input"] + top[0]["tokens"]["output"] == tokens_of(leader)


def test_spans_and_usage_events_carry_them_metrics_do_not(traffic, delivered, receiver):
    spans = [s for s in genai_spans(receiver.spans) if s.scope == "otel_llm.vllm"]
    on_spans = Counter(
        (s.attributes.get(semconv.API_KEY_ID, "-"), s.attributes.get(semconv.USER_ID, "-")) for s in spans
    )
    assert on_spans == traffic[1]
    events = [r for r in receiver.logs if r.event_name == semconv.USAGE_EVENT]
    assert (
        Counter((r.attributes.get(semconv.API_KEY_ID, "-"), r.attributes.get(semconv.USER_ID, "-")) for r in events)
        == traffic[1]
    )
    with receiver._lock:
        points = [p for batch in receiver.metric_batches for p in batch]
    assert any(p.attributes.get(semconv.TENANT_ID) == "acme" for p in points)
    assert not [p.name for p in points if {semconv.API_KEY_ID, semconv.USER_ID} & set(p.attributes)]


def test_no_key_nor_its_hash_leaves(traffic, delivered, receiver, spool, vllm):
    with receiver._lock:
        places = [(f"OTLP {signal}", body) for signal, body in receiver.bodies]
    places += [(f"spool {p.name}", p.read_bytes()) for p in sorted(spool.iterdir())]
    places.append(("server output", vllm.log_path.read_bytes()))
    assert {"OTLP traces", "OTLP metrics", "OTLP logs"} <= {where for where, _ in places}
    # the search is meaningful: the default id, a prefix of the hash, is there
    assert any(BATCH_ID.encode() in data for where, data in places if where == "OTLP traces")
    secrets_ = {}
    for key in (PROD_KEY, BATCH_KEY, OTHER_KEY):
        secrets_[key[:9] + " key"] = key
        secrets_[key[:9] + " sha256"] = hashlib.sha256(key.encode()).hexdigest()
    leaks = {
        label: sorted({where for where, data in places if value.encode() in data}) for label, value in secrets_.items()
    }
    assert {label: where for label, where in leaks.items() if where} == {}

"""Tenant values a client can send, on the real vLLM CPU server: UTF-8 arrives intact, an
oversized value is ignored (one warning, never cut), and with an API-key map made-up tenant
headers cannot take the metric label slots of the tenants the map names, while spans and the
usage ledger keep every (valid) value in full."""

import hashlib
import json
import secrets

import httpx
import pytest
from helpers import Traceparent, genai_spans, request_trace, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger

KEY = f"sk-acme-{secrets.token_hex(8)}"
JUNK = [f"junk-{i:02d}" for i in range(60)]  # more than the 50 label slots


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants")
    keys = work / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "acme"}]}))
    srv = start_server(
        receiver,
        tmp_path_factory,
        "tenants",
        env={"OTEL_LLM_API_KEYS_FILE": str(keys), "OTEL_LLM_USAGE_DIR": str(work / "usage")},
    )
    srv.spool = work / "usage"
    yield srv
    srv.stop()


def complete(server, headers):
    tp = Traceparent()
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        headers={**tp.headers(), **headers},
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    return tp.trace_id


def test_utf8_arrives_intact_and_an_oversized_value_is_ignored(server, receiver):
    # (control characters and 16 KB headers never get past the HTTP server: it answers 400 itself)
    for raw, expected in (("租户-é".encode(), "租户-é"), (b"x" * 4096, None), (b"y" * 129, None)):
        (genai,) = genai_spans(request_trace(receiver, complete(server, {"x-tenant-id": raw})))
        assert genai.attributes.get(semconv.TENANT_ID) == expected
    assert server.log_path.read_text().count("tenant/scene/cost-center value was ignored") == 1
    assert "租户-é" in {r.get(semconv.TENANT_ID) for r in ledger.read_spool(str(server.spool))}


def test_made_up_tenants_cannot_take_the_label_slots_of_vouched_ones(server, receiver):
    for tenant in JUNK:
        complete(server, {"x-tenant-id": tenant})
    complete(server, {"authorization": f"Bearer {KEY}"})  # vLLM runs without --api-key: any key passes

    def labels(rx):
        found = {p.attributes.get(semconv.TENANT_ID) for p in rx.latest_metrics() if p.name == semconv.SERVER_REQUESTS}
        return found if "acme" in found else None

    assert receiver.wait_for(labels, 30) >= {"acme", semconv.LABEL_OTHER}
    assert not {label for label in receiver.wait_for(labels, 30) if label and label.startswith("junk-")}
    # spans and the ledger keep every value
    billed = {r.get(semconv.TENANT_ID) for r in ledger.read_spool(str(server.spool))}
    assert set(JUNK) | {"acme"} <= billed

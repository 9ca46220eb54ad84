"""Budgets that hold for every tenant (issue 22), end to end: the instrumented vLLM CPU server writes
the usage ledger; `otel-llm budget-server` reads it; the example gateway asks it before each request;
a real Prometheus scrapes it and evaluates `otel-llm budget-rules`.

- 120 tenants with budgets, far beyond the metric label cap (50 tenants per process): each one is
  refused by the gateway once over (429, OpenAI-style error, Retry-After, the reason on the span,
  nothing sent upstream), and each one's BudgetExceeded alert fires in Prometheus.
- Concurrent requests at the edge of a budget: the overshoot is at most the requests in flight when
  the budget ran out (the tracker read through before each wave: the documented bound's other term,
  requests admitted during the tracker's lag, is zero here).
"""

import json
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import Traceparent, start_server

from devkit.devserver import BudgetServer, GatewayServer, PrometheusServer, otlp_env, write_keys_file
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing.ledger import read_spool
from otel_llm.billing.promql import yaml_text
from otel_llm.ops import budgets

TENANTS = [f"tenant-{i:03d}" for i in range(120)]
EDGE = "edge"
EDGE_BUDGET = 400  # tokens per day
WAVE = 4  # concurrent requests per wave at the edge
KEYS = {tenant: f"sk-{tenant}-{secrets.token_hex(8)}" for tenant in [*TENANTS, EDGE]}
OUTPUT_TOKENS = 4


@pytest.fixture(scope="module")
def stack(receiver, tmp_path_factory):
    work = tmp_path_factory.mktemp("budgets")
    usage = work / "usage"
    vllm = start_server(receiver, tmp_path_factory, "budgets", env={"OTEL_LLM_USAGE_DIR": str(usage)})
    budget_file = work / "budgets.json"
    budget_file.write_text(
        json.dumps(
            {"budgets": [{"tenant": t, "tokens": 1} for t in TENANTS] + [{"tenant": EDGE, "tokens": EDGE_BUDGET}]}
        )
    )
    rules = budgets.rules(budgets.load(budget_file))
    for group in rules["groups"]:
        group["interval"] = "1s"  # (the generated groups are evaluated every minute)
    (work / "rules.yml").write_text(yaml_text(rules))
    tracker = BudgetServer(budget_file, str(usage), log_path=work / "budget-server.log")
    keys = write_keys_file(work / "keys.json", {KEYS[t]: (t, None) for t in KEYS})
    gateway = GatewayServer(
        vllm.url,
        keys,
        env={**otlp_env(receiver.endpoint, service_name="llm-gateway"), "GATEWAY_BUDGETS_URL": tracker.url},
        log_path=work / "gateway.log",
    )
    started = []
    try:
        for server in (tracker, gateway):
            server.start()
            started.append(server)
        prometheus = PrometheusServer([f"127.0.0.1:{tracker.port}"], work, rule_files=[work / "rules.yml"])
        prometheus.start()
        started.append(prometheus)
        yield {"vllm": vllm, "tracker": tracker, "gateway": gateway, "prometheus": prometheus, "usage": usage}
    finally:
        for server in reversed(started):
            server.stop()
        vllm.stop()


def chat(stack, tenant, tp=None, prompt="budget check"):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}", **(tp.headers() if tp else {})}
    return httpx.post(stack["gateway"].url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def read_through(stack, bills: int, timeout: float = 60) -> dict:
    """The tracker's state once it has counted `bills` bills."""
    deadline = time.monotonic() + timeout
    while True:
        state = stack["tracker"].state()
        if state["bills"] >= bills or time.monotonic() > deadline:
            assert state["bills"] == bills, state["bills"]
            return state
        time.sleep(0.2)


def ledger_tokens(stack, tenant) -> list[int]:
    return [
        r[semconv.GEN_AI_USAGE_INPUT_TOKENS] + r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
        for r in read_spool(str(stack["usage"]))
        if r.get(semconv.TENANT_ID) == tenant
    ]


def test_every_budgeted_tenant_is_refused_once_over_and_alerted(stack, receiver):
    with ThreadPoolExecutor(6) as pool:
        first = list(pool.map(lambda t: chat(stack, t), TENANTS))
    assert [r.status_code for r in first] == [200] * len(TENANTS), [r.text for r in first if r.status_code != 200]
    state = read_through(stack, len(TENANTS))
    over = {b["tenant"] for b in state["budgets"] if b["state"] == semconv.BUDGET_STATE_OVER}
    assert over == set(TENANTS)

    traces = {t: Traceparent() for t in TENANTS}
    seconds_left = 86400 - time.time() % 86400  # (at most: the day's end, as the tracker will say)
    with ThreadPoolExecutor(6) as pool:
        second = dict(zip(TENANTS, pool.map(lambda t: chat(stack, t, traces[t]), TENANTS)))
    for tenant, response in second.items():
        assert response.status_code == 429, (tenant, response.text)
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("insufficient_quota", semconv.ERROR_BUDGET_EXCEEDED)
        assert "day tokens budget: used" in error["message"]
        assert 0 < int(response.headers["retry-after"]) <= seconds_left + 1
    # nothing went upstream: one bill per tenant, its first request
    assert {t: len(ledger_tokens(stack, t)) for t in TENANTS} == {t: 1 for t in TENANTS}

    # the reason is on the gateway's span
    tp = traces[TENANTS[7]]
    spans = receiver.wait_for(
        lambda rx: [s for s in rx.traces().get(tp.trace_id, []) if s.kind == "SERVER"], timeout=60
    )
    (span,) = spans
    assert span.attributes[semconv.BUDGET_STATE] == semconv.BUDGET_STATE_OVER
    assert span.attributes[semconv.ERROR_TYPE] == semconv.ERROR_BUDGET_EXCEEDED
    assert span.attributes[semconv.TENANT_ID] == TENANTS[7]

    # each tenant's alert fires in the real Prometheus
    deadline = time.monotonic() + 120
    while True:
        with urllib.request.urlopen(stack["prometheus"].url + "/api/v1/alerts", timeout=30) as r:
            alerts = json.loads(r.read())["data"]["alerts"]
        firing = {
            a["labels"]["tenant"]
            for a in alerts
            if a["labels"]["alertname"] == budgets.ALERT_OVER and a["state"] == "firing"
        }
        if firing >= set(TENANTS) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert firing == set(TENANTS)


def test_concurrent_requests_at_the_edge_overshoot_by_at_most_the_requests_in_flight(stack):
    bills = read_through(stack, len(TENANTS) if stack["tracker"].state()["bills"] >= len(TENANTS) else 0)["bills"]
    admitted = refused = waves = 0
    while not refused:
        with ThreadPoolExecutor(WAVE) as pool:
            responses = list(pool.map(lambda _: chat(stack, EDGE), range(WAVE)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        refused = codes.count(429)
        admitted += codes.count(200)
        # (a wave's later requests may see its earlier ones' bills: the tracker reads every 0.2 s)
        bills = read_through(stack, bills + codes.count(200))["bills"]
        waves += 1
        assert waves < 100
    spent = ledger_tokens(stack, EDGE)
    per_request = max(spent)
    assert len(spent) == admitted
    assert sum(spent) >= EDGE_BUDGET  # it ran out
    assert sum(spent) - EDGE_BUDGET < WAVE * per_request  # by no more than the requests in flight
    state = stack["tracker"].state()
    (edge,) = [b for b in state["budgets"] if b["tenant"] == EDGE]
    assert edge["used"] == sum(spent)  # the tracker's figure is the ledger's, to the token

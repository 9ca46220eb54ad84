"""Every PromQL query of every generated dashboard, and every rule of otel-llm-rules.yml, against a
real Prometheus scraping the instrumented vLLM CPU server after some traffic: each must parse and
return data (alerting rules: their left-hand side, since thresholds legitimately return nothing)."""

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml
from helpers import LONG_PROMPT, start_server

from devkit.devserver import PrometheusServer
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing.prices import load_prices
from otel_llm.ops import dashboards, price_rules, rules

VALUES = {
    "model": MODEL_NAME,
    "tenant": ".*",
    "scene": ".*",
    "cost_center": ".*",
    "__rate_interval": "1m",
    "__range": "5m",
    "__interval": "15s",
    **{name: default for name, _, default in dashboards.PRICES},
}
# A second name of the served model, which the price file does not price: the dashboard's price variables
UNPRICED_MODEL = f"{MODEL_NAME}-unpriced"
FILE_PRICES = {"input": 1.0, "cached_input": 0.25, "output": 4.0}  # MODEL_NAME's, half the variables' defaults

# Alerts whose left-hand side returns nothing here, and why; the listed expressions stand in for it.
NO_DATA = {
    # vLLM's default "request_tokens" buckets are 1-2-5 up to max_model_len: no bucket at 90 % of
    # 8192 (7372) exists unless vLLM is started with --custom-histogram-buckets, so the subtraction
    # matches nothing. Its +Inf halves must have data.
    "LLMRequestNearMaxModelLen": [
        f'sum by ({semconv.VLLM_LABEL_MODEL}) (increase({semconv.VLLM_METRIC_PROMPT_TOKENS}_bucket{{le="+Inf"}}[5m]))',
        f"sum by ({semconv.VLLM_LABEL_MODEL}) "
        f'(increase({semconv.VLLM_METRIC_GENERATION_TOKENS}_bucket{{le="+Inf"}}[5m]))',
    ],
    # a healthy server has no failure series (one appears at a point's first failure): the whole
    # expression must parse; promtool fires it (tests/operator/test_prometheus_rules.py) and the
    # fault run counts failures on the real server (tests/e2e/reliability/test_faults_e2e.py)
    "LLMInstrumentationFailing": [],
    # the tenant anomaly baselines end an hour ago, before this server started: the recorded
    # current rates stand in (promtool fires them, tests/operator/test_prometheus_rules.py)
    **{
        name: [rules.TENANT_REQUESTS, rules.TENANT_TOKENS]
        for name in ("LLMTenantRequestRateHigh", "LLMTenantTokensPerRequestHigh", "LLMTenantOutputLengthHigh")
    },
    # a running engine: the token counters grew, and the instance has not vanished
    "LLMEngineStalled": [
        semconv.VLLM_METRIC_RUNNING,
        f"increase({semconv.VLLM_METRIC_GENERATION_TOKENS_TOTAL}[2m])",
        f"increase({semconv.VLLM_METRIC_PROMPT_TOKENS_TOTAL}[2m])",
    ],
    "LLMInstanceDown": [f"group by (job, instance) (max_over_time({semconv.VLLM_METRIC_RUNNING}[1h]))"],
}


def substitute(expr: str) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: VALUES[m.group(1)], expr)


def alert_sides(expr: str) -> list[str]:
    """The left-hand sides of an alert's comparisons (`a > 1 and on (x) b > 2` -> [a, b])."""
    parts = re.split(r"\s+and(?:\s+on\s*\([^)]*\))?\s+", expr)
    return [re.split(r"\s+[<>]=?\s+", part, maxsplit=1)[0] for part in parts]


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory):
    # a usage spool: the engine core accounts each request's compute (the cost dashboard's GPU panels)
    # an n-gram speculator: the speculative-decoding panel has data
    speculator = json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    )
    srv = start_server(
        receiver,
        tmp_path_factory,
        "dashboards",
        extra_args=[
            "--enable-prompt-tokens-details",
            "--served-model-name",
            MODEL_NAME,
            UNPRICED_MODEL,
            "--speculative-config",
            speculator,
            "--per-request-spec-decode-metrics",
            "summary",
        ],
        env={
            "OTEL_METRICS_EXPORTER": "otlp,prometheus_vllm",
            "OTEL_LLM_METRIC_LABEL_LIMIT": "50",
            "OTEL_LLM_USAGE_DIR": str(tmp_path_factory.mktemp("usage")),
        },
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    """otel-llm-rules.yml with its group interval at 2 s instead of 1 m, so that recording rules
    have data within the test; the expressions are the committed ones."""
    data = yaml.safe_load(rules.render())
    for group in data["groups"]:
        group["interval"] = "2s"
    path = tmp_path_factory.mktemp("rules") / "otel-llm-rules.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=1000))
    return path


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory):
    """`otel-llm price-rules` of a price file that prices MODEL_NAME only (evaluated every 2 s)."""
    directory = tmp_path_factory.mktemp("prices")
    (directory / "prices.json").write_text(json.dumps({"models": {MODEL_NAME: FILE_PRICES}}))
    data = yaml.safe_load(price_rules.render(*load_prices(directory / "prices.json"), "prices.json"))
    data["groups"][0]["interval"] = "2s"
    (directory / "prices.yml").write_text(yaml.safe_dump(data, sort_keys=False))
    return directory / "prices.yml"


@pytest.fixture(scope="module")
def prometheus(vllm, rules_file, prices_file, tmp_path_factory):
    prom = PrometheusServer(
        [f"127.0.0.1:{vllm.port}"], tmp_path_factory.mktemp("prometheus"), rule_files=[rules_file, prices_file]
    )
    prom.start()
    yield prom
    prom.stop()


def query(prometheus, expr: str, at: float | None = None) -> dict:
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    url = f"{prometheus.url}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}") | {"http_status": e.code}


@pytest.fixture(scope="module")
def traffic(vllm, prometheus):
    deadline = time.monotonic() + 30  # the first scrape sees every counter before the traffic
    while not query(prometheus, "up == 1")["data"]["result"] and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    started = time.monotonic()
    client = openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-dashboards", max_retries=0)

    def chat(tenant, scene, content, max_tokens=8, stream=False, model=MODEL_NAME):
        headers = {"x-tenant-id": tenant, "x-scene": scene, **({"x-cost-center": "cc-rd"} if tenant == "alpha" else {})}
        kwargs = dict(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, extra_headers=headers
        )
        if stream:
            return list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        return client.chat.completions.create(**kwargs)

    for i in range(6):
        chat(("alpha", "beta", "gamma")[i % 3], ("search", "chatbot")[i % 2], f"hello {i}", stream=i % 2 == 0)
    cached = 0
    for _ in range(2):  # the second one hits the prefix cache
        time.sleep(2)  # a scrape between the two: rate() sees the cached tokens' increase from 0
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=LONG_PROMPT,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-tenant-id": "beta", "x-scene": "rag"},
            )
        )
        details = chunks[-1].usage.prompt_tokens_details
        cached = (details.cached_tokens if details else 0) or 0
    assert cached > 0
    # two 404s, a scrape apart: the first makes the error series (born at 1, which rate() cannot
    # see as an increase), the second is an increase
    for _ in range(2):
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="no-such-model",
                messages=[{"role": "user", "content": "x"}],
                extra_headers={"x-tenant-id": "delta"},
            )
        time.sleep(2)
    # concurrent requests: some wait in vLLM's queue
    with ThreadPoolExecutor(12) as pool:
        list(
            pool.map(
                lambda i: chat(f"tenant-{i % 4}", "batch", f"concurrent {i} " * 20, max_tokens=24, stream=i % 3 == 0),
                range(24),
            )
        )
    # keep a trickle going, on both model names, until ~30 s after the start, and for 10 s at least (a busy
    # machine may take 30 s before it: the unpriced name and the speculator's panels need the trickle)
    trickle_until = max(started + 30, time.monotonic() + 10)
    while time.monotonic() < trickle_until:
        chat("alpha", "search", "trickle", max_tokens=4)
        chat("gamma", "chatbot", "unpriced trickle", max_tokens=5, model=UNPRICED_MODEL)
        # a prompt that repeats itself, greedy: the n-gram speculator proposes drafts (17 of 40 tokens)
        client.completions.create(
            model=MODEL_NAME,
            prompt="a b c d a b c d a b c d a b c d",
            max_tokens=40,
            temperature=0,
            extra_headers={"x-tenant-id": "alpha", "x-scene": "search"},
        )
    time.sleep(5)  # a few scrapes and rule evaluations after the last request


def dashboard_queries():
    return [
        (name, title, expr)
        for name, board in dashboards.dashboards().items()
        for title, expr in dashboards.promql_targets(board)
    ]


def test_every_dashboard_query_parses_and_returns_data(prometheus, traffic):
    failures = []
    for name, title, expr in dashboard_queries():
        body = query(prometheus, substitute(expr))
        if body.get("status") != "success" or not body["data"]["result"]:
            failures.append(
                {
                    "dashboard": name,
                    "panel": title,
                    "expr": substitute(expr),
                    "answer": {k: v for k, v in body.items() if k != "data"}
                    | {"result": body.get("data", {}).get("result")},
                }
            )
    assert not failures, json.dumps(failures, indent=1)
    assert len(dashboard_queries()) > 40


def panel_series(prometheus, title, at=None, **values) -> list[tuple[dict, float]]:
    [expr] = [e for _, t, e in dashboard_queries() if t == title][:1]
    return evaluate(prometheus, expr, at, **values)


def evaluate(prometheus, expr, at=None, **values) -> list[tuple[dict, float]]:
    """expr's series and values, its variables from VALUES and `values`."""
    old = dict(VALUES)
    VALUES.update(values)
    try:
        body = query(prometheus, substitute(expr), at)
    finally:
        VALUES.clear()
        VALUES.update(old)
    return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]


def panel_values(prometheus, title, **values):
    return [value for _, value in panel_series(prometheus, title, **values)]


def test_panels_show_the_traffic(prometheus, traffic):
    assert sum(panel_values(prometheus, "Requests/s by outcome")) > 0
    assert len([v for v in panel_values(prometheus, "Tokens/s by type") if v > 0]) == 3
    assert panel_values(prometheus, "Prefix cache hit rate")[0] > 0
    assert panel_values(prometheus, "Time to first token")[0] > 0
    assert max(panel_values(prometheus, "Cost in range")) > 0
    assert max(panel_values(prometheus, "Cache savings in range")) > 0
    # the 404 is counted under the model name the client sent, not under tiny-llama
    assert panel_values(prometheus, "Error rate") == [0]
    assert panel_values(prometheus, "Error rate", model=".*")[0] > 0
    # both causes are shown, at 0: the export process kept up with the traffic
    assert panel_values(prometheus, "Telemetry dropped/s") == [0, 0]


def test_each_model_at_its_price(prometheus, traffic):
    """MODEL_NAME at the price file's prices (the recorded price series), UNPRICED_MODEL at the dashboard's
    price variables: each panel's cost equals the model's token counts (same window, same instant) at them."""
    model, token_type = dashboards.MODEL, dashboards.TOKEN_TYPE
    recorded = query(prometheus, price_rules.PRICE)["data"]["result"]
    assert {(r["metric"][model], r["metric"][token_type], float(r["value"][1])) for r in recorded} == {
        (MODEL_NAME, t, price) for t, price in FILE_PRICES.items()
    }
    variables = {t: float(VALUES[f"price_{t}"]) for t in FILE_PRICES}
    assert variables == {t: 2 * price for t, price in FILE_PRICES.items()}  # the two must differ
    at = time.time()
    used = {}
    for r in query(prometheus, f"sum by ({model}, {token_type}) (increase({dashboards.TOKENS}[5m]))", at)["data"][
        "result"
    ]:
        used[r["metric"][model], r["metric"][token_type]] = float(r["value"][1])
    assert used[UNPRICED_MODEL, semconv.TOKEN_TYPE_INPUT] > 0 and used[MODEL_NAME, semconv.TOKEN_TYPE_CACHED_INPUT] > 0

    def expected(name, prices):
        tokens = {t: used.get((name, t), 0.0) for t in FILE_PRICES}
        uncached = tokens[semconv.TOKEN_TYPE_INPUT] - tokens[semconv.TOKEN_TYPE_CACHED_INPUT]
        return (
            uncached * prices[semconv.TOKEN_TYPE_INPUT]
            + tokens[semconv.TOKEN_TYPE_OUTPUT] * prices[semconv.TOKEN_TYPE_OUTPUT]
            + tokens[semconv.TOKEN_TYPE_CACHED_INPUT] * prices[semconv.TOKEN_TYPE_CACHED_INPUT]
        ) / 1e6

    costs = {m[model]: v for m, v in panel_series(prometheus, "Cost in range by model", at, model=".*")}
    want = {MODEL_NAME: expected(MODEL_NAME, FILE_PRICES), UNPRICED_MODEL: expected(UNPRICED_MODEL, variables)}
    assert costs == pytest.approx(want, rel=1e-9) and all(v > 0 for v in want.values())
    [(_, total)] = panel_series(prometheus, "Cost in range", at, model=".*")
    assert total == pytest.approx(sum(want.values()), rel=1e-9)
    # alpha's requests carry cost center cc-rd; the others none
    by_center = {
        m.get(dashboards.COST_CENTER): v
        for m, v in panel_series(prometheus, "Cost in range by cost center", at, model=".*")
    }
    assert set(by_center) == {"cc-rd", None} and sum(by_center.values()) == pytest.approx(total, rel=1e-9)
    [(_, rd)] = panel_series(prometheus, "Cost in range", at, model=".*", cost_center="cc-rd")
    assert rd == pytest.approx(by_center["cc-rd"], rel=1e-9) and 0 < rd < total
    # 11 tenant / scene pairs sent requests: the table shows the 10 that cost most
    pairs = evaluate(prometheus, dashboards.cost_of(f"{dashboards.TENANT}, {dashboards.SCENE}"), at, model=".*")
    top = panel_series(prometheus, "Top consumers in range (tenant / scene)", at, model=".*")
    assert len(pairs) >= 11 and len(top) == 10
    assert sorted(v for _, v in top) == sorted(v for _, v in pairs)[-10:]


def test_every_rule_parses_and_returns_data(prometheus, traffic):
    groups = yaml.safe_load(rules.render())["groups"]
    failures, checked = [], 0
    for rule in (r for g in groups for r in g["rules"]):
        body = query(prometheus, rule["expr"])  # the whole expression must parse
        if body.get("status") != "success":
            failures.append({"rule": rule.get("record") or rule["alert"], "answer": body})
            continue
        if "record" in rule:
            sides = [rule["expr"], rule["record"]]  # the expression, and the series Prometheus recorded
        else:
            sides = NO_DATA[rule["alert"]] if rule["alert"] in NO_DATA else alert_sides(rule["expr"])
        for expr in sides:
            checked += 1
            answer = query(prometheus, expr)
            if answer.get("status") != "success" or not answer["data"]["result"]:
                failures.append({"rule": rule.get("record") or rule["alert"], "expr": expr, "answer": answer})
    assert not failures, json.dumps(failures, indent=1)
    assert checked >= 2 * 13 + 9


def test_alert_sides():
    assert alert_sides('a{x="1"} > 3') == ['a{x="1"}']
    assert alert_sides("a < 0.2 and on (m) sum by (m) (rate(b[5m])) > 1") == ["a", "sum by (m) (rate(b[5m]))"]
    assert alert_sides("r > 2 * (x + y) / 7") == ["r"]

"""`otel-llm report` on real data: the instrumented vLLM CPU server serving our token counter on its
own /metrics, a real Prometheus (Debian package) scraping it every second, several tenants
(non-stream, n=2, streams, a prefix-cache hit, an aborted stream). The report must equal, per
tenant and model, the `usage` the responses carried, and per model vLLM's own token counters."""

import io
import json
import secrets
import time
from collections import Counter
from types import SimpleNamespace

import openai
import pytest
from helpers import LONG_PROMPT, Traceparent, abandon_stream, start_server

from devkit.devserver import write_keys_file
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import report
from otel_llm.ops import budget_view

DELTA_KEY = f"sk-delta-{secrets.token_hex(12)}"  # mapped to tenant delta by OTEL_LLM_API_KEYS_FILE


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory):
    keys = write_keys_file(tmp_path_factory.mktemp("keys") / "api-keys.json", {DELTA_KEY: ("delta", "ops")})
    data = json.loads(keys.read_text())
    data["keys"][0]["cost_center"] = "cc-42"
    keys.write_text(json.dumps(data))
    # --max-model-len 2048: a stream long enough to be abandoned while the engine still generates
    srv = start_server(
        receiver,
        tmp_path_factory,
        "report",
        extra_args=["--enable-prompt-tokens-details", "--max-model-len", "2048"],
        env={
            "OTEL_METRICS_EXPORTER": "otlp,prometheus_vllm",
            "OTEL_LLM_API_KEYS_FILE": str(keys),
            # with a key map, only what it names gets labels unless an allow-list says more
            "OTEL_LLM_METRIC_LABEL_ALLOW_LIST": "alpha,beta,gamma,delta,search,chatbot,batch,ops,cc-7,cc-42",
        },
        paced=True,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def traffic(vllm, prometheus):
    """Requests per tenant; returns the usage the responses reported, per (tenant, token type)."""
    started = time.time()
    billed = Counter()
    client = openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-report", max_retries=0)

    def book(tenant, usage):
        billed[(tenant, semconv.TOKEN_TYPE_INPUT)] += usage.prompt_tokens
        billed[(tenant, semconv.TOKEN_TYPE_OUTPUT)] += usage.completion_tokens
        details = usage.prompt_tokens_details
        billed[(tenant, semconv.TOKEN_TYPE_CACHED_INPUT)] += (details.cached_tokens if details else 0) or 0

    alpha = {"x-tenant-id": "alpha", "x-scene": "search", "x-cost-center": "cc-7"}
    book(
        "alpha",
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=7, extra_headers=alpha
        ).usage,
    )
    two = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "two"}], max_tokens=5, n=2, extra_headers=alpha
    ).usage
    book("alpha", two)
    beta = {"x-tenant-id": "beta", "x-scene": "chatbot"}
    for _ in range(2):  # the second one hits the prefix cache
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=LONG_PROMPT,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=beta,
            )
        )
        book("beta", chunks[-1].usage)
    assert billed[("beta", semconv.TOKEN_TYPE_CACHED_INPUT)] > 0
    # gamma stops reading a long stream: no usage reaches it, the engine still counted its tokens
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 1900,
        "ignore_eos": True,
    }
    gamma = abandon_stream(
        vllm.url,
        "/v1/chat/completions",
        body,
        lambda: {"x-tenant-id": "gamma", "x-scene": "batch", **Traceparent().headers()},
    )
    # delta is named by its API key alone (the key map wins over headers); one of its calls fails
    delta = openai.OpenAI(base_url=vllm.url + "/v1", api_key=DELTA_KEY, max_retries=0)
    book(
        "delta",
        delta.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "d"}],
            max_tokens=4,
            extra_headers={"x-tenant-id": "spoofed"},
        ).usage,
    )
    with pytest.raises(openai.NotFoundError):
        delta.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "d"}])
    time.sleep(0.5)
    # vLLM's own vllm:prompt_tokens_total counts an n=2 request's prompt twice (once per choice);
    # usage, and so billing, counts it once
    return SimpleNamespace(
        billed=billed, started=started, prompt_counted_twice=two.prompt_tokens, gamma_ran_to_end=len(gamma) - 1
    )


def run_report(prometheus, *argv, now=None):
    parser_args = ["report", "--prometheus", prometheus.url, *argv]
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    report.add_arguments(sub.add_parser("report"))
    args = parser.parse_args(parser_args)
    out, err = io.StringIO(), io.StringIO()
    code = budget_view.run_report(args, now=now or time.time(), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def vllm_total(prometheus, name):
    return sum(int(float(r["value"][1])) for r in prometheus.query(name))


def report_rows(prometheus, traffic, *extra):
    code, out, err = run_report(prometheus, "--start", str(int(traffic.started) - 60), "--format", "json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_report_equals_usage_per_tenant_and_vllm_counters_per_model(prometheus, traffic):
    expected_models = {
        semconv.TOKEN_TYPE_INPUT: "vllm:prompt_tokens_total",
        semconv.TOKEN_TYPE_OUTPUT: "vllm:generation_tokens_total",
        semconv.TOKEN_TYPE_CACHED_INPUT: "vllm:prompt_tokens_cached_total",
    }

    def settled():
        data = report_rows(prometheus, traffic, "--by", "tenant,model")
        got = {(r["tenant"], t): n for r in data["rows"] for t, n in r["tokens"].items()}
        ok = all(got.get(k) == v for k, v in traffic.billed.items())
        totals = dict(data["total"]["tokens"])
        totals[semconv.TOKEN_TYPE_INPUT] += traffic.prompt_counted_twice
        engine = {t: vllm_total(prometheus, name) for t, name in expected_models.items()}
        return (data, got) if ok and totals == engine else None

    deadline = time.monotonic() + 30
    result = settled()
    while result is None and time.monotonic() < deadline:
        time.sleep(1)
        result = settled()
    data = report_rows(prometheus, traffic, "--by", "tenant,model")
    engine = {t: vllm_total(prometheus, name) for t, name in expected_models.items()}
    if result is None:
        pytest.fail(
            json.dumps(
                {
                    "rows": data["rows"],
                    "total": data["total"],
                    "engine": engine,
                    "billed": {"/".join(k): v for k, v in traffic.billed.items()},
                }
            )
        )
    data, got = result
    assert {r["model"] for r in data["rows"]} == {MODEL_NAME}
    for key, tokens in traffic.billed.items():
        assert got[key] == tokens, key
    # gamma: no usage reached it, but the engine counted its prompt and what it generated
    assert got[("gamma", semconv.TOKEN_TYPE_OUTPUT)] > 0
    assert got[("gamma", semconv.TOKEN_TYPE_INPUT)] > 0


def test_report_by_scene_and_day_with_prices(prometheus, traffic, tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(
        json.dumps({"currency": "EUR", "models": {MODEL_NAME: {"input": 2.0, "cached_input": 0.5, "output": 8.0}}})
    )
    data = report_rows(prometheus, traffic, "--by", "tenant,scene,model,day", "--prices", str(prices))
    assert data["currency"] == "EUR"
    today = time.strftime("%Y-%m-%d", time.gmtime())
    beta = [r for r in data["rows"] if r["tenant"] == "beta"]
    assert [(r["scene"], r["day"]) for r in beta] == [("chatbot", today)]
    t = beta[0]["tokens"]
    assert t == {k[1]: v for k, v in traffic.billed.items() if k[0] == "beta"}
    uncached = t["input"] - t["cached_input"]
    assert beta[0]["cost"] == pytest.approx((uncached * 2.0 + t["cached_input"] * 0.5 + t["output"] * 8.0) / 1e6)
    assert beta[0]["cache_savings"] == pytest.approx(t["cached_input"] * 1.5 / 1e6)
    assert data["total"]["cost"] == pytest.approx(sum(r["cost"] for r in data["rows"]))


def test_report_table_and_csv(prometheus, traffic):
    code, out, _ = run_report(
        prometheus, "--start", str(int(traffic.started) - 60), "--by", "tenant", "--format", "csv"
    )
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == "tenant,input,cached_input,output"
    assert lines[-1].startswith("TOTAL,")
    alpha = [line for line in lines if line.startswith("alpha,")][0].split(",")
    assert [int(x) for x in alpha[1:]] == [traffic.billed[("alpha", t)] for t in report.TOKEN_TYPES]
    code, out, _ = run_report(prometheus, "--start", str(int(traffic.started) - 60), "--by", "tenant")
    assert code == 0 and "alpha" in out and "TOTAL" in out


def test_report_of_a_window_before_the_traffic_is_empty(prometheus, traffic):
    data = report_rows(
        prometheus, SimpleNamespace(started=traffic.started - 3600), "--end", str(int(traffic.started) - 1800)
    )
    assert data["rows"] == [] and data["total"]["tokens"] == dict.fromkeys(report.TOKEN_TYPES, 0)


def test_requests_by_outcome_tenant_and_cost_center(prometheus, traffic, receiver):
    name = semconv.prometheus_metric(semconv.SERVER_REQUESTS)
    outcome, tenant, cost_center = (
        semconv.prometheus_label(a) for a in (semconv.REQUEST_OUTCOME, semconv.TENANT_ID, semconv.TENANT_COST_CENTER)
    )
    expected = {
        ("alpha", "finished", "cc-7"): 2,
        ("beta", "finished", "-"): 2,
        ("gamma", "aborted", "-"): 1,
        ("delta", "finished", "cc-42"): 1,
        ("delta", "error", "cc-42"): 1,
    }
    if traffic.gamma_ran_to_end:  # streams vLLM finished before it saw the client leave
        expected[("gamma", "finished", "-")] = traffic.gamma_ran_to_end

    def counted():
        found = {}
        for r in prometheus.query(f"sum by ({tenant}, {outcome}, {cost_center}) ({name})"):
            m = r["metric"]
            found[(m.get(tenant), m.get(outcome), m.get(cost_center, "-"))] = int(float(r["value"][1]))
        return found

    deadline = time.monotonic() + 20
    while counted() != expected and time.monotonic() < deadline:
        time.sleep(1)
    assert counted() == expected
    data = report_rows(prometheus, traffic, "--by", "tenant,cost_center")
    assert {(r["tenant"], r["cost_center"]) for r in data["rows"]} == {
        ("alpha", "cc-7"),
        ("beta", "-"),
        ("gamma", "-"),
        ("delta", "cc-42"),
    }
    # over OTLP the counter's points carry exemplars (in the export after each add): the traces of
    # counted requests
    points = [p for batch in receiver.metric_batches for p in batch if p.name == semconv.SERVER_REQUESTS]
    exemplar_traces = {e["trace_id"] for p in points for e in p.exemplars}
    assert exemplar_traces and exemplar_traces <= set(receiver.traces())
    # the API key is only ever hashed: not in any series Prometheus holds
    series = json.dumps(prometheus.query('{__name__=~".+"}'))
    assert DELTA_KEY not in series and "spoofed" not in series


def test_budget_view_against_real_usage(prometheus, traffic, tmp_path):
    path = tmp_path / "budgets.json"
    path.write_text(
        json.dumps(
            {
                "budgets": [
                    {"tenant": "alpha", "tokens_per_day": 10},
                    {"tenant": "beta", "scene": "chatbot", "tokens_per_day": 10**9},
                    {"tenant": "delta", "tokens_per_day": 10**9, "token_types": ["output"]},
                ]
            }
        )
    )
    code, out, err = run_report(
        prometheus, "--budgets", str(path), "--start", str(int(traffic.started) - 60), "--format", "json"
    )
    assert code == 1, err  # a budget is over: non-zero, for scripts and cron
    status = {b["tenant"]: b for b in json.loads(out)["budgets"]}
    billed = traffic.billed
    assert status["alpha"]["used"] == billed[("alpha", "input")] + billed[("alpha", "output")]
    assert status["alpha"]["state"] == "over"
    assert (status["beta"]["scene"], status["beta"]["state"]) == ("chatbot", "ok")
    assert status["beta"]["used"] == billed[("beta", "input")] + billed[("beta", "output")]
    assert status["delta"]["used"] == billed[("delta", "output")]
    code, out, _ = run_report(prometheus, "--budgets", str(path), "--start", str(int(traffic.started) - 60))
    assert code == 1 and "alpha" in out and "over" in out

"""The generated Grafana dashboards: committed files equal the generator (`otel-llm dashboards`),
every PromQL query reads a metric that our instrumentation, our recording rules or vLLM emits, every
TraceQL query reads span attributes our spans carry, and the JSON is importable anywhere."""

import subprocess
import sys
from pathlib import Path

import pytest

from otel_llm import semconv
from otel_llm.billing import promql
from otel_llm.ops import dashboards, price_rules, rules

DASHBOARDS_DIR = Path(__file__).resolve().parents[2] / "dashboards"


def test_committed_dashboards_equal_the_generator():
    committed = {p.name: p.read_text() for p in DASHBOARDS_DIR.glob("*.json")}
    assert committed == dashboards.render(), "stale: run `make generate`"


def test_dashboards_command(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "otel_llm.cli", "dashboards", *args], capture_output=True, text=True, cwd=tmp_path
        )  # no repository paths: runs anywhere

    assert run("--out", "d").returncode == 0
    assert {p.name: p.read_text() for p in (tmp_path / "d").iterdir()} == dashboards.render()
    one = run("--name", "cost.json")
    assert one.returncode == 0 and one.stdout == dashboards.render()["cost.json"]
    assert run("--out", "e", "--name", "traces.json").returncode == 0
    assert [p.name for p in (tmp_path / "e").iterdir()] == ["traces.json"]
    bad = run("--name", "nope.json")
    assert bad.returncode == 2 and "no dashboard 'nope.json'" in bad.stderr
    assert run().returncode == 2


def test_every_query_reads_what_is_emitted():
    assert dashboards.problems() == []


def test_an_unknown_metric_is_reported():
    boards = dashboards.dashboards()
    boards["latency.json"]["panels"][1]["targets"][0]["expr"] = (
        'sum(rate(vllm:no_such_metric_total{model_name=~"$model"}[5m])) / sum(rate(otel_llm_made_up_total[5m]))'
    )
    title = boards["latency.json"]["panels"][1]["title"]
    assert dashboards.problems(boards) == [
        f"latency.json: panel {title!r} queries otel_llm_made_up_total, which nothing emits",
        f"latency.json: panel {title!r} queries vllm:no_such_metric_total, which nothing emits",
    ]


def test_a_misspelt_recording_rule_is_reported():
    boards = {
        "x.json": dashboards.dashboard(
            "x",
            "x",
            [
                dashboards.panel(
                    "p", [dashboards.target(f"{rules.TOKENS_BY_TENANT}x > 0 and {rules.TOKENS_BY_TENANT} > 0")]
                )
            ],
        )
    }
    assert dashboards.problems(boards) == [f"x.json: panel 'p' queries {rules.TOKENS_BY_TENANT}x, which nothing emits"]


def test_an_unknown_span_attribute_is_reported():
    usage_only = semconv.USAGE_ID  # a usage record field, never on a span
    assert semconv.VLLM not in semconv.ATTRIBUTES[usage_only].emitted_by
    boards = {
        "t.json": dashboards.dashboard(
            "t",
            "t",
            [
                dashboards.panel(
                    "slow",
                    [
                        {
                            "datasource": dashboards.TEMPO,
                            "queryType": "traceql",
                            "refId": "A",
                            "query": f'{{ span.{semconv.VLLM_TTFT_SECONDS} > 2 && span.made.up = "x" '
                            f"&& span.{usage_only} != nil }}",
                        }
                    ],
                    datasource=dashboards.TEMPO,
                )
            ],
        )
    }
    assert dashboards.problems(boards) == [
        "t.json: panel 'slow' reads span.made.up, which no span carries",
        f"t.json: panel 'slow' reads span.{usage_only}, which no span carries",
    ]


@pytest.mark.parametrize(
    "expr, names",
    [
        ('sum by (le) (rate(a_bucket{x=~"$model", y="b c"}[$__rate_interval]))', {"a_bucket"}),
        (
            'x:y:rate5m{quantile="0.95"} > 3 and on (m) sum by (m) (rate(b_total[5m] offset 1d)) > 1',
            {"x:y:rate5m", "b_total"},
        ),
        ("(sum(rate(c[1m])) or vector(0)) / (sum(rate(d[1m])) > 0) * $price_input / 1e6", {"c", "d"}),
    ],
)
def test_metric_names(expr, names):
    assert promql.metric_names(expr) == names


def test_known_metrics():
    known = promql.known_metrics()
    assert {
        f"{rules.TTFT}_bucket",
        f"{rules.TTFT}_count",
        rules.TOKENS,
        semconv.VLLM_METRIC_WAITING,
        f"{semconv.VLLM_METRIC_QUEUE_TIME}_sum",
    } <= known
    assert rules.TTFT not in known and semconv.VLLM_METRIC_QUEUE_TIME not in known  # histograms: by series


@pytest.mark.parametrize("name", sorted(dashboards.dashboards()))
def test_panels_and_variables(name):
    board = dashboards.dashboards()[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["prometheus"]["type"] == "datasource" and variables["prometheus"]["query"] == "prometheus"
    assert variables["tempo"]["type"] == "datasource" and variables["tempo"]["query"] == "tempo"
    for v in ("model", "tenant", "scene"):
        assert variables[v]["type"] == "query" and variables[v]["definition"].startswith("label_values(")
        assert variables[v]["datasource"]["uid"] == "${prometheus}"
    if name == "cost.json":
        assert {"price_input", "price_cached_input", "price_output"} <= set(variables)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"].startswith("otel-llm-")
    for p in board["panels"]:
        assert p["datasource"]["uid"] in ("${prometheus}", "${tempo}"), p["title"]
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            assert ("expr" in t) == (p["datasource"]["type"] == "prometheus")


def test_trace_links():
    # every latency query on a raw histogram (recording rules carry no exemplars)
    latency = [
        t
        for b in dashboards.dashboards().values()
        for p in b["panels"]
        for t in p["targets"]
        if p["fieldConfig"]["defaults"]["unit"] == "s" and "_bucket" in t["expr"]
    ]
    assert len(latency) > 20 and all(t["exemplar"] for t in latency)
    tempo = [t["query"] for p in dashboards.traces()["panels"] for t in p["targets"] if "query" in t]
    assert any("span.vllm.latency.time_to_first_token > 2" in q for q in tempo)
    assert any("span.gen_ai.usage.input_tokens > 4000" in q for q in tempo)


def test_dashboards_cover_the_brief():
    exprs = {n: " ".join(e for _, e in dashboards.promql_targets(b)) for n, b in dashboards.dashboards().items()}
    for metric in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:num_preemptions_total",
        "histogram_quantile(0.99",
        "otel_llm_request_outcome",
    ):
        assert metric in exprs["overview.json"], metric
    for metric in (
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ):
        assert metric in exprs["latency.json"], metric
    assert "$price_cached_input" in exprs["cost.json"] and "tenant_id" in exprs["cost.json"]


def test_cost_dashboard_panels():
    board = dashboards.cost()
    panels = {p["title"]: p for p in board["panels"]}
    variables = {v["name"]: v for v in board["templating"]["list"]}
    cost_center = semconv.prometheus_label(semconv.TENANT_COST_CENTER)
    assert variables["cost_center"]["definition"] == f"label_values({rules.TOKENS}, {cost_center})"
    assert variables["cost_center"]["allValue"] == ".*"  # series without a cost center stay in "All"
    assert "cost_center" not in {v["name"] for v in dashboards.overview()["templating"]["list"]}
    # today's and this month's cost: Grafana's "Today so far" / "This month so far" on the panel
    for title, time_from in (("Cost today", "now/d"), ("Cost this month", "now/M"), ("Cost in range", None)):
        p = panels[title]
        assert p["type"] == "stat" and p["fieldConfig"]["defaults"]["unit"] == "currencyUSD"
        assert p.get("timeFrom") == time_from and p.get("hideTimeOverride", False) == (time_from is not None)
        [t] = p["targets"]
        assert t["instant"] and not t["range"] and t["expr"] == dashboards.cost_of("")
    for title, label in (
        ("Cost in range by model", rules.MODEL),
        ("Cost in range by tenant", rules.TENANT),
        ("Cost in range by cost center", cost_center),
    ):
        assert panels[title]["type"] == "bargauge"
        assert panels[title]["targets"][0]["expr"] == f"sort_desc({dashboards.cost_of(label)})"
    top = panels["Top consumers in range (tenant / scene)"]
    assert top["type"] == "table"
    assert top["targets"][0]["expr"] == f"topk(10, {dashboards.cost_of(f'{rules.TENANT}, {dashboards.SCENE}')})"
    exprs = [e for _, e in dashboards.promql_targets(board)]
    priced = [e for e in exprs if price_rules.PRICE in e]
    # every token cost panel reads the recorded prices, with the price variables as the fallback
    assert len(priced) == 10 and all("$price_input" in e and "$price_cached_input" in e for e in priced)
    assert all(f'{cost_center}=~"$cost_center"' in e for e in exprs if rules.TOKENS in e)
    assert sum("$gpu_usd_per_hour" in e for e in exprs) == 2  # the engine cost panels stay

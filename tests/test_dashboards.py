"""The generated Grafana dashboards: committed files equal the generator, every query names a metric
that our instrumentation, our recording rules or vLLM emits, and the JSON is importable anywhere."""

import json
import shutil

import pytest

from otel_llm import dashboards, rules


def test_committed_dashboards_equal_the_generator(capsys):
    assert dashboards.main(["--check"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in dashboards.DASHBOARDS_DIR.glob("*.json")) == sorted(dashboards.dashboards())


def test_check_fails_on_an_edited_copy(tmp_path, capsys):
    copy = shutil.copytree(dashboards.DASHBOARDS_DIR, tmp_path / "d")
    board = json.loads((copy / "overview.json").read_text())
    board["panels"][0]["title"] = "edited by hand"
    (copy / "overview.json").write_text(json.dumps(board, indent=2) + "\n")
    assert dashboards.main(["--check", "-d", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "overview.json is not what" in err and "latency.json" not in err


def test_check_fails_on_a_missing_file(tmp_path, capsys):
    copy = shutil.copytree(dashboards.DASHBOARDS_DIR, tmp_path / "d")
    (copy / "cost.json").unlink()
    assert dashboards.main(["--check", "-d", str(copy)]) == 1
    assert "cost.json" in capsys.readouterr().err


def test_check_fails_on_an_unknown_metric_in_a_file(tmp_path, capsys):
    copy = shutil.copytree(dashboards.DASHBOARDS_DIR, tmp_path / "d")
    board = json.loads((copy / "latency.json").read_text())
    board["panels"][1]["targets"][0]["expr"] = 'sum(rate(vllm:no_such_metric_total{model_name=~"$model"}[5m]))'
    (copy / "latency.json").write_text(json.dumps(board, indent=2) + "\n")
    assert dashboards.main(["--check", "-d", str(copy)]) == 1
    assert "queries vllm:no_such_metric_total, which nothing emits" in capsys.readouterr().err


def test_check_fails_when_the_generator_queries_an_unknown_metric(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(dashboards.VLLM_METRICS, "running", "vllm:num_requests_runing")
    dashboards.main(["-d", str(tmp_path)])  # files equal to the (broken) generator
    assert dashboards.main(["--check", "-d", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "vllm:num_requests_runing is not defined by the installed vLLM" in err


def test_unknown_names_outside_the_known_set_are_reported(monkeypatch, tmp_path, capsys):
    original = dashboards.emitted_metrics
    monkeypatch.setattr(dashboards, "emitted_metrics", lambda: original() - {rules.TOKENS})
    dashboards.main(["-d", str(tmp_path)])
    assert dashboards.main(["--check", "-d", str(tmp_path)]) == 1
    assert f"queries {rules.TOKENS}, which nothing emits" in capsys.readouterr().err


@pytest.mark.parametrize("expr, names", [
    ('sum by (le) (rate(a_bucket{x=~"$model", y="b c"}[$__rate_interval]))', {"a_bucket"}),
    ("x:y:rate5m{quantile=\"0.95\"} > 3 and on (m) sum by (m) (rate(b_total[5m] offset 1d)) > 1",
     {"x:y:rate5m", "b_total"}),
    ("(sum(rate(c[1m])) or vector(0)) / (sum(rate(d[1m])) > 0) * $price_input / 1e6", {"c", "d"}),
])
def test_metric_names(expr, names):
    assert dashboards.metric_names(expr) == names


def test_vllm_names_exist_in_the_installed_vllm():
    pytest.importorskip("vllm")
    assert dashboards.vllm_missing() == []


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
    latency = [t for b in dashboards.dashboards().values() for p in b["panels"] for t in p["targets"]
               if p["fieldConfig"]["defaults"]["unit"] == "s" and "_bucket" in t["expr"]]
    assert len(latency) > 20 and all(t["exemplar"] for t in latency)
    tempo = [t["query"] for p in dashboards.traces()["panels"] for t in p["targets"] if "query" in t]
    assert any("span.vllm.latency.time_to_first_token > 2" in q for q in tempo)
    assert any("span.gen_ai.usage.input_tokens > 4000" in q for q in tempo)


def test_dashboards_cover_the_brief():
    exprs = {n: " ".join(e for _, e in dashboards.promql_targets(b)) for n, b in dashboards.dashboards().items()}
    for metric in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running",
                   "vllm:num_preemptions_total", "histogram_quantile(0.99", "otel_llm_request_outcome"):
        assert metric in exprs["overview.json"], metric
    for metric in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                   "vllm:request_decode_time_seconds"):
        assert metric in exprs["latency.json"], metric
    assert "$price_cached_input" in exprs["cost.json"] and "tenant_id" in exprs["cost.json"]

"""Token budgets: the budget file's checks, the generated Prometheus rules under the real promtool
(`check rules`, and `test rules` firing and not firing each alert)."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from otel_llm import budgets, promql, semconv
from otel_llm.promql import ReportError

TOKENS = semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE)
TENANT = semconv.prometheus_label(semconv.TENANT_ID)
SCENE = semconv.prometheus_label(semconv.TENANT_SCENE)
TYPE = semconv.prometheus_label(semconv.GEN_AI_TOKEN_TYPE)
PROMTOOL = shutil.which("promtool")
BUDGETS = {"budgets": [
    {"tenant": "acme", "tokens_per_day": 1000},
    {"tenant": "acme", "scene": "batch", "tokens_per_day": 500, "warn_ratio": 0.9, "token_types": ["output"]},
    {"tenant": "globex", "tokens_per_day": 100000},
]}


def write(tmp_path, data, name="budgets.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("data,message", [
    ("{", "is not valid JSON"),
    ({"budgets": []}, "expected"),
    ({"budgets": [{"tokens_per_day": 5}]}, "needs a tenant"),
    ({"budgets": [{"tenant": "a", "tokens_per_day": 0}]}, "tokens_per_day must be a whole number > 0"),
    ({"budgets": [{"tenant": "a", "tokens_per_day": 1.5}]}, "tokens_per_day must be a whole number > 0"),
    ({"budgets": [{"tenant": "a", "tokens_per_day": 5, "warn_ratio": 1.2}]}, "warn_ratio must be between 0 and 1"),
    ({"budgets": [{"tenant": "a", "tokens_per_day": 5, "token_types": ["prompt"]}]}, "token_types must be among"),
    ({"budgets": [{"tenant": "a", "tokens_per_day": 5}, {"tenant": "a", "tokens_per_day": 6}]},
     "a has a budget already"),
])
def test_malformed_budget_files(tmp_path, data, message):
    with pytest.raises(ReportError, match=message):
        budgets.load(write(tmp_path, data))


def test_rules_select_the_tenant_scene_and_token_types(tmp_path):
    rules = budgets.rules(budgets.load(write(tmp_path, BUDGETS)))["groups"][0]["rules"]
    assert [(r["alert"], r["labels"]["severity"]) for r in rules[:2]] == [
        (budgets.ALERT_NEAR, "warning"), (budgets.ALERT_OVER, "critical")]
    assert rules[0]["expr"] == (f'sum(increase({TOKENS}{{{TENANT}="acme",{TYPE}=~"input|output"}}[1d])) '
                                f'> 0.8 * 1000')
    assert rules[3]["expr"] == f'sum(increase({TOKENS}{{{TENANT}="acme",{SCENE}="batch",{TYPE}=~"output"}}[1d])) > 500'
    assert rules[3]["labels"] == {"tenant": "acme", "scene": "batch", "severity": "critical"}


def test_budget_rules_cli(tmp_path):
    out = tmp_path / "rules.yml"
    result = subprocess.run([sys.executable, "-m", "otel_llm.cli", "budget-rules", "--budgets",
                             str(write(tmp_path, BUDGETS)), "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(out.read_text()) == budgets.rules(budgets.load(tmp_path / "budgets.json"))
    bad = subprocess.run([sys.executable, "-m", "otel_llm.cli", "budget-rules", "--budgets",
                          str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("otel-llm budget-rules: budget file")


def test_budgets_do_not_import_the_report():
    code = "import sys, otel_llm.budgets; print('otel_llm.report' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"


def test_any_tenant_name_survives_the_rule_file(tmp_path):
    names = ['a "quoted" \\ one', "it's", "yes", "x: y", "日本", "tab\there", "#1"]
    data = {"budgets": [{"tenant": n, "tokens_per_day": 10} for n in names]}
    text = budgets.rules_yaml(budgets.load(write(tmp_path, data)))
    loaded = yaml.safe_load(text)
    assert loaded == budgets.rules(budgets.load(tmp_path / "budgets.json"))
    assert [r["labels"]["tenant"] for r in loaded["groups"][0]["rules"][::2]] == names
    if PROMTOOL:
        (tmp_path / "rules.yml").write_text(text)
        check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                               text=True)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is installed by `make test`")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    (tmp_path / "rules.yml").write_text(budgets.rules_yaml(budgets.load(write(tmp_path, BUDGETS))))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 6 rules found" in check.stdout, check.stdout + check.stderr

    def series(tenant, token_type, values, scene="support"):
        return {"series": f'{TOKENS}{{{TENANT}="{tenant}",{SCENE}="{scene}",{TYPE}="{token_type}"}}',
                "values": values}

    def alert(name, labels, value, budget, ratio=None, types="input+output"):
        who = labels["tenant"] + (f"/{labels['scene']}" if "scene" in labels else "")
        over = f"over {ratio} of its daily budget of {budget}" if ratio else f"over its daily budget of {budget}"
        description = ("A tenant (or one of its scenes) is close to its daily token budget." if ratio else
                       "A tenant (or one of its scenes) used more tokens in the last 24 h than its daily budget.")
        name = budgets.ALERT_NEAR if ratio else budgets.ALERT_OVER
        return {"exp_labels": {**labels, "severity": "warning" if ratio else "critical"},
                "exp_annotations": {"summary": f"{who}: {value} tokens ({types}) in the last 24 h, {over}",
                                    "description": description, "runbook_url": promql.runbook_url(name)}}

    acme, batch = {"tenant": "acme"}, {"tenant": "acme", "scene": "batch"}
    near, over = budgets.ALERT_NEAR, budgets.ALERT_OVER
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        # acme (all scenes) counts 20 input+output tokens a minute: 10 input and 5 output in scene
        # support, 5 output in batch; its cached input does not count by default. Budget 1000: near
        # after 40 min, over after 50. acme/batch counts its 5 output a minute: budget 500, warned
        # at 90%: near after 90 min, over after 100. globex stays far under its budget.
        "input_series": [series("acme", "input", "0+10x200"), series("acme", "output", "0+5x200"),
                         series("acme", "cached_input", "0+1000x200"),
                         series("acme", "output", "0+5x200", scene="batch"),
                         series("globex", "input", "0+10x200")],
        "alert_rule_test": [
            {"eval_time": "35m", "alertname": near, "exp_alerts": []},
            {"eval_time": "45m", "alertname": near, "exp_alerts": [alert(near, acme, "900", 1000, "80%")]},
            {"eval_time": "45m", "alertname": over, "exp_alerts": []},
            {"eval_time": "95m", "alertname": over, "exp_alerts": [alert(over, acme, "1.9k", 1000)]},
            {"eval_time": "95m", "alertname": near, "exp_alerts": [
                alert(near, batch, "475", 500, "90%", "output"), alert(near, acme, "1.9k", 1000, "80%")]},
            {"eval_time": "105m", "alertname": over, "exp_alerts": [
                alert(over, batch, "525", 500, types="output"), alert(over, acme, "2.1k", 1000)]},
        ],
    }]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr

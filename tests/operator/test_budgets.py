"""Token budgets: the budget file's checks, the generated Prometheus rules under the real promtool
(`check rules`, and `test rules` firing and not firing each alert)."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from otel_llm import semconv
from otel_llm.billing.promql import ReportError
from otel_llm.ops import budgets

TOKENS = semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE)
TENANT = semconv.prometheus_label(semconv.TENANT_ID)
SCENE = semconv.prometheus_label(semconv.TENANT_SCENE)
TYPE = semconv.prometheus_label(semconv.GEN_AI_TOKEN_TYPE)
PERIOD = semconv.prometheus_label(semconv.BUDGET_PERIOD)
UNIT = semconv.prometheus_label(semconv.BUDGET_UNIT)
USED = semconv.prometheus_metric(semconv.BUDGET_USED)
LIMIT = semconv.prometheus_metric(semconv.BUDGET_LIMIT)
LAG = semconv.prometheus_metric(semconv.BUDGET_TRACKER_LAG)
PROMTOOL = shutil.which("promtool")
BUDGETS = {
    "budgets": [
        {"tenant": "acme", "tokens_per_day": 1000},
        {"tenant": "acme", "scene": "batch", "tokens_per_day": 500, "warn_ratio": 0.9, "token_types": ["output"]},
        {"tenant": "globex", "tokens_per_day": 100000},
    ]
}


def write(tmp_path, data, name="budgets.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    "data,message",
    [
        ("{", "is not valid JSON"),
        ({"budgets": []}, "expected"),
        ({"budgets": [{"tokens_per_day": 5}]}, "needs a tenant"),
        ({"budgets": [{"tenant": "a", "tokens_per_day": 0}]}, "tokens_per_day must be a whole number > 0"),
        ({"budgets": [{"tenant": "a", "tokens_per_day": 1.5}]}, "tokens_per_day must be a whole number > 0"),
        ({"budgets": [{"tenant": "a", "tokens_per_day": 5, "warn_ratio": 1.2}]}, "warn_ratio must be between 0 and 1"),
        ({"budgets": [{"tenant": "a", "tokens_per_day": 5, "token_types": ["prompt"]}]}, "token_types must be among"),
        (
            {"budgets": [{"tenant": "a", "tokens_per_day": 5}, {"tenant": "a", "tokens_per_day": 6}]},
            "a day tokens has a budget already",
        ),
    ],
)
def test_malformed_budget_files(tmp_path, data, message):
    with pytest.raises(ReportError, match=message):
        budgets.load(write(tmp_path, data))


def test_rules_read_the_trackers_series_of_each_budget(tmp_path):
    rules = budgets.rules(budgets.load(write(tmp_path, BUDGETS)))["groups"][0]["rules"]
    assert [(r["alert"], r["labels"]["severity"]) for r in rules[:3]] == [
        (budgets.ALERT_NEAR, "warning"),
        (budgets.ALERT_OVER, "critical"),
        (budgets.ALERT_UNWATCHED, "critical"),
    ]
    acme = f'{{{TENANT}="acme",{SCENE}="",{PERIOD}="day",{UNIT}="tokens"}}'
    assert rules[0]["expr"] == f"{USED}{acme} / {LIMIT}{acme} > 0.8"
    assert rules[1]["expr"] == f"{USED}{acme} / {LIMIT}{acme} >= 1"
    assert rules[2]["expr"] == f"absent({LIMIT}{acme})"
    batch = f'{{{TENANT}="acme",{SCENE}="batch",{PERIOD}="day",{UNIT}="tokens"}}'
    assert rules[3]["expr"] == f"{USED}{batch} / {LIMIT}{batch} > 0.9"
    assert rules[4]["labels"] == {"tenant": "acme", "scene": "batch", "period": "day", "severity": "critical"}
    assert rules[-1]["alert"] == budgets.ALERT_TRACKER_BEHIND


def test_money_budgets_are_labelled_with_the_price_files_currency(tmp_path):
    (budget,) = budgets.load(write(tmp_path, {"budgets": [{"tenant": "a", "period": "month", "cost": 5}]}))
    assert budgets.labels(budget, "EUR")[UNIT] == "EUR"
    with pytest.raises(ReportError, match="money budgets need the price file"):
        budgets.check_watchable([budget], {})


def test_budget_rules_cli(tmp_path):
    out = tmp_path / "rules.yml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_llm.cli",
            "budget-rules",
            "--budgets",
            str(write(tmp_path, BUDGETS)),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(out.read_text()) == budgets.rules(budgets.load(tmp_path / "budgets.json"))
    bad = subprocess.run(
        [sys.executable, "-m", "otel_llm.cli", "budget-rules", "--budgets", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("otel-llm budget-rules: budget file")


def test_budgets_do_not_import_the_report():
    code = "import sys, otel_llm.ops.budgets; print('otel_llm.billing.report' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"


def test_any_tenant_name_survives_the_rule_file(tmp_path):
    names = ['a "quoted" \\ one', "it's", "yes", "x: y", "日本", "#1", "{{ $value }}"]
    data = {"budgets": [{"tenant": n, "tokens_per_day": 10} for n in names]}
    text = budgets.rules_yaml(budgets.load(write(tmp_path, data)))
    loaded = yaml.safe_load(text)
    assert loaded == budgets.rules(budgets.load(tmp_path / "budgets.json"))
    assert [r["labels"]["tenant"] for r in loaded["groups"][0]["rules"][:-1:3]] == names
    if PROMTOOL:
        (tmp_path / "rules.yml").write_text(text)
        check = subprocess.run(
            [PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is installed by `make test`")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    """120 tenants, far beyond the metric label cap (50): each budget's alerts fire on its own series."""
    data = {
        "budgets": [{"tenant": f"tenant-{i:03d}", "tokens": 1000} for i in range(120)]
        + [
            {"tenant": "acme", "scene": "batch", "period": "month", "cost": 10, "warn_ratio": 0.5},
            {"tenant": "unserved", "tokens": 10},
        ]
    }
    loaded = budgets.load(write(tmp_path, data))
    (tmp_path / "rules.yml").write_text(budgets.rules_yaml(loaded, "USD"))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0 and f"SUCCESS: {3 * len(loaded) + 1} rules found" in check.stdout, check.stdout

    def series(metric, budget, values):
        labels = ",".join(f'{k}="{v}"' for k, v in budgets.labels(budget, "USD").items())
        return {"series": f'{metric}{{{labels},instance="b:9470",job="budgets"}}', "values": values}

    served = loaded[:-1]  # the tracker serves every budget but the last
    # tenant-i uses 100 tokens a minute from minute i % 12: near (> 800) after 9 minutes, over after 10
    inputs = [series(LIMIT, b, "1000x40") for b in served[:-1]] + [
        series(USED, b, f"{'0x' + str(i % 12) + ' ' if i % 12 else ''}0+100x{40 - i % 12}")
        for i, b in enumerate(served[:-1])
    ]
    inputs += [
        series(LIMIT, served[-1], "10x40"),
        series(USED, served[-1], "0+1x40"),
        {"series": f'{LAG}{{instance="b:9470",job="budgets"}}', "values": "0x10 0+60x30"},
    ]

    def alert(budget, severity, name, summary=None):
        labels = {k: v for k, v in budgets.labels(budget, "USD").items() if v}  # ("" is no label)
        labels.update({"tenant": budget.tenant, "period": budget.period, "severity": severity})
        if budget.scene:
            labels["scene"] = budget.scene
        if name != budgets.ALERT_UNWATCHED:
            labels.update({"instance": "b:9470", "job": "budgets"})
        rule = next(r for r in budgets.rules([budget], "USD")["groups"][0]["rules"] if r["alert"] == name)
        return {"exp_labels": labels, "exp_annotations": {**rule["annotations"], "summary": summary}}

    def summary(budget, share, what):
        return f"{budget.name}: {share} of its {budget.period} budget used{what}"

    over, near = ": over its limit", ", over 50%"
    count_firing = "count(count by (tenant_id, tenant_scene) (ALERTS{alertname=%r, alertstate='firing'}))"
    # every tenant is over 10 min after it began (at most 11 min in); acme/batch uses 1 of its 10 a minute
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": budgets.ALERT_OVER, "exp_alerts": []},
                    {
                        "eval_time": "10m",
                        "alertname": budgets.ALERT_OVER,
                        "exp_alerts": [
                            alert(b, "critical", budgets.ALERT_OVER, summary(b, "100%", over))
                            for i, b in enumerate(served)
                            if i % 12 == 0 or b is served[-1]
                        ],
                    },
                    {
                        "eval_time": "6m",
                        "alertname": budgets.ALERT_NEAR,
                        "exp_alerts": [
                            alert(served[-1], "warning", budgets.ALERT_NEAR, summary(served[-1], "60%", near))
                        ],
                    },
                    {"eval_time": "4m", "alertname": budgets.ALERT_UNWATCHED, "exp_alerts": []},
                    {
                        "eval_time": "6m",
                        "alertname": budgets.ALERT_UNWATCHED,
                        "exp_alerts": [
                            alert(
                                loaded[-1],
                                "critical",
                                budgets.ALERT_UNWATCHED,
                                f"{loaded[-1].name}: no budget tracker serves this budget",
                            )
                        ],
                    },
                    {"eval_time": "13m", "alertname": budgets.ALERT_TRACKER_BEHIND, "exp_alerts": []},
                ],
                "promql_expr_test": [
                    {
                        "expr": count_firing % budgets.ALERT_OVER,
                        "eval_time": "22m",
                        "exp_samples": [{"labels": "{}", "value": len(served)}],
                    },
                    {
                        "expr": count_firing % budgets.ALERT_TRACKER_BEHIND,
                        "eval_time": "16m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    },
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

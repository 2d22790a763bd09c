"""deploy/prometheus/rules: the real promtool checks them (`promtool check rules`) and runs their
unit tests (`promtool test rules deploy/prometheus/tests/*.yml`: each alert fires on a synthetic
series and stays quiet on a healthy one, each recording rule evaluates to its expected value);
the class budgets and the canary threshold are the values of the code they mirror, so they
cannot drift. promtool missing is a failure, not a skip: CI installs it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ops.prometheus_rules import RULES_DIR, all_rules, recorded, series_names
from ops.rollout import Thresholds
from python_backends.admission.classes import CACHED_ENTRIES, CLASSES
from python_backends.routing.router import CALLS_METRIC

ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = ROOT / "deploy" / "prometheus" / "tests"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: scripts/setup.sh installs it with the Debian package "
            "prometheus (apt-get install prometheus); the rule tests need the real one",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return all_rules()


def alerts(rules, name=None):
    return [r for r in rules if "alert" in r and (name is None or r["alert"] == name)]


def test_promtool_check_rules(promtool):
    files = sorted(RULES_DIR.glob("*.yml"))
    assert files, f"no rules files in {RULES_DIR}"
    out = subprocess.run([promtool, "check", "rules", *map(str, files)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    found = sum(int(n) for n in re.findall(r"SUCCESS: (\d+) rules found", out.stdout))
    assert found == len(all_rules()) >= 10


def test_promtool_rule_unit_tests(promtool, rules):
    files = sorted(TESTS_DIR.glob("*.yml"))
    assert files, f"no promtool tests in {TESTS_DIR}"
    out = subprocess.run(
        [promtool, "test", "rules", *map(str, files)], capture_output=True, text=True, timeout=120, cwd=TESTS_DIR
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
    # Every alert is tested firing (an exp_alerts entry) and quiet (an empty exp_alerts) somewhere,
    # and every recording rule is evaluated by a promql_expr_test.
    import yaml

    fired, quiet, evaluated = set(), set(), set()
    for path in files:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else quiet).add(check["alertname"])
            for check in case.get("promql_expr_test", []):
                evaluated |= series_names(check["expr"])
    names = {r["alert"] for r in alerts(rules)}
    assert names - fired == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"
    assert recorded(rules) - evaluated == set(), "recording rules never evaluated"


def test_queue_p99_thresholds_are_the_class_budgets(rules):
    by_class = {}
    for rule in alerts(rules, "PriorityClassQueueP99OverBudget"):
        cls = rule["labels"]["priority_class"]
        m = re.fullmatch(r'model:nv_inference_queue_time_us:p99\{model="([a-z_]+)"\} > (\d+)', rule["expr"].strip())
        assert m, rule["expr"]
        by_class[cls] = (m.group(1), int(m.group(2)), rule["labels"]["budget_ms"])
    assert set(by_class) == set(CLASSES)
    for name, cls in CLASSES.items():
        model, threshold_us, label = by_class[name]
        assert model == CACHED_ENTRIES[name], name
        assert threshold_us == cls.budget_ms * 1000, name
        assert label == str(cls.budget_ms), name


def test_canary_threshold_is_what_ops_rollout_judges(rules):
    (rule,) = alerts(rules, "CanaryErrorRateHigh")
    limits = Thresholds()
    expr = " ".join(rule["expr"].split())
    assert f"version:canary_encoder_error_rate:ratio_rate2m > {limits.max_error_rate}" in expr
    assert f">= {limits.min_requests}" in expr
    (ratio,) = [r for r in rules if r.get("record") == "version:canary_encoder_error_rate:ratio_rate2m"]
    assert series_names(ratio["expr"]) == {CALLS_METRIC}
    # the rollout's error rate: failed / (ok + failed), "rejected" (invalid input) left out
    assert 'result="error"' in ratio["expr"] and 'result=~"ok|error"' in ratio["expr"]


def test_fill_rate_and_error_thresholds(rules):
    (fill,) = alerts(rules, "EmbeddingPaddingFillRateLow")
    assert fill["expr"].strip() == "job:embedding_padding_fill_rate:ratio_rate5m < 0.6" and fill["for"] == "5m"
    (kv,) = alerts(rules, "LLMKVCacheUsageHigh")
    assert kv["expr"].strip() == "instance:llm_kv_cache_usage:ratio > 0.9"
    for name in ("InferenceErrorRateHigh", "GatewayErrorRateHigh"):
        (rule,) = alerts(rules, name)
        assert "> 0.01" in rule["expr"]
    (down,) = alerts(rules, "TritonReplicaDown")
    assert down["expr"].strip() == 'up{job="triton"} == 0'


def test_every_alert_has_severity_annotations_and_for(rules):
    assert len(alerts(rules)) >= 9
    for rule in alerts(rules):
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip(), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


def test_every_recorded_name_an_alert_reads_is_recorded(rules):
    defined = recorded(rules)
    for rule in alerts(rules):
        wanted = {n for n in series_names(rule["expr"]) if ":" in n}
        assert wanted <= defined, (rule["alert"], wanted - defined)


def test_series_names():
    expr = 'sum by (job, model) (rate(a_total{x="y:z",q=~"a|b"}[5m])) / on (model) b{l="1"} > 0.5 and up == 0'
    assert series_names(expr) == {"a_total", "b", "up"}

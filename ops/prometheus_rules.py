"""What a Prometheus rules file (deploy/prometheus/rules/*.yml) reads and defines.

Used by the tests that check no rule watches a series the servers do not expose
(tests/integration/test_metrics.py) and that the thresholds follow the code they mirror
(tests/unit/test_prometheus_rules.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules"

# PromQL words that look like metric names: aggregations, functions, operators, modifiers.
_KEYWORDS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def load(path: Path) -> list[dict]:
    """Every rule of a rules file (record and alert rules), each with its group's name added."""
    doc = yaml.safe_load(Path(path).read_text())
    return [{**rule, "group": group["name"]} for group in doc["groups"] for rule in group["rules"]]


def all_rules(directory: Path = RULES_DIR) -> list[dict]:
    return [rule for path in sorted(Path(directory).glob("*.yml")) for rule in load(path)]


def series_names(expr: str) -> set[str]:
    """The metric names (and recorded names) a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)  # label lists
    names = set()
    for match in _NAME.finditer(text):
        name = match.group(0)
        rest = text[match.end() :].lstrip()
        if name.lower() in _KEYWORDS or rest.startswith("("):  # a keyword or a function call
            continue
        names.add(name)
    return names


def recorded(rules: list[dict]) -> set[str]:
    return {rule["record"] for rule in rules if "record" in rule}


def scraped_names(rules: list[dict]) -> set[str]:
    """The names the rules read from scrapes: every selected name that no rule records."""
    used = set().union(*(series_names(rule["expr"]) for rule in rules))
    return used - recorded(rules)

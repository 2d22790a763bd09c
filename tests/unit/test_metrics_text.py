"""The tests' Prometheus reader fails on a metric that is not there (tests/metrics_text.py)."""

from __future__ import annotations

import pytest

from tests.metrics_text import metric_series, metric_sum, series_names

TEXT = """# HELP requests_total Requests.
# TYPE requests_total counter
requests_total{model="a",code="200"} 3
requests_total{model="a",code="500"} 1
requests_total{model="b",code="200"} 5
# HELP hits_total Hits, none yet.
# TYPE hits_total counter
# HELP nv_inference_request_success Successful requests (a counter without _total, as tritonserver's).
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="a",version="1"} 7
# HELP up Up.
# TYPE up gauge
up 1
"""


def test_sums_the_series_whose_labels_include_those_asked():
    assert metric_sum(TEXT, "requests_total") == 9
    assert metric_sum(TEXT, "requests_total", model="a") == 4
    assert metric_sum(TEXT, "requests_total", model="a", code="500") == 1
    assert metric_sum(TEXT, "up") == 1
    assert metric_sum(TEXT, "nv_inference_request_success", model="a") == 7


def test_a_family_without_a_matching_series_is_0_unless_a_series_is_required():
    assert metric_sum(TEXT, "hits_total") == 0 and metric_sum(TEXT, "requests_total", model="c") == 0
    with pytest.raises(AssertionError, match="no series"):
        metric_sum(TEXT, "requests_total", series=True, model="c")


def test_a_metric_not_in_the_scrape_fails():
    with pytest.raises(AssertionError, match="not in the scrape"):
        metric_sum(TEXT, "request_total")  # a typo


def test_a_name_the_scrape_does_not_write_fails_though_the_parser_knows_its_family():
    """The parser names tritonserver's counter samples <name>_total and a <name>_total counter's
    family <name>; a selector must name the series as written, so neither other form passes."""
    with pytest.raises(AssertionError, match="not in the scrape"):
        metric_sum(TEXT, "nv_inference_request_success_total")
    with pytest.raises(AssertionError, match="not in the scrape"):
        metric_sum(TEXT, "requests")
    assert series_names(TEXT) == {"requests_total", "nv_inference_request_success", "up"}


def test_each_series_with_its_labels():
    assert sorted(v for _, v in metric_series(TEXT, "requests_total", code="200")) == [3, 5]
    assert metric_series(TEXT, "nv_inference_request_success") == [({"model": "a", "version": "1"}, 7)]
    assert metric_series(TEXT, "hits_total") == []

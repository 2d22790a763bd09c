"""One reader of Prometheus text for the tests (prometheus_client's own parser): the sum of a
metric's series whose labels include the ones asked for. A metric whose family is not in the
scrape at all fails the test, so a renamed or mistyped metric cannot read as 0 and pass an
`== 0` check; a family present without a matching series (a labelled counter not incremented
yet) sums to 0, or fails with ``series=True``.

Names are the series names as the scrape writes them (and as Prometheus stores them): the parser
reads tritonserver's ``nv_inference_request_success`` counter as ``..._total`` samples, and a
``gateway_requests_total`` counter as the family ``gateway_requests``; neither
``nv_inference_request_success_total`` nor ``gateway_requests`` is a series of those scrapes, and
asking for one fails as a name not in the scrape does."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SUFFIXES = ("", "_total", "_count", "_sum", "_bucket", "_created", "_info")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def series_names(text: str) -> set[str]:
    """The name of every sample in the scrape, as written (what a PromQL selector must name)."""
    parsed = {s.name for family in text_string_to_metric_families(text) for s in family.samples}  # a text it cannot read fails
    written = {
        _NAME.match(line.lstrip()).group(0) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    }
    # the parser read each of them (itself, or a counter's with the _total it adds)
    assert all(n in parsed or n + "_total" in parsed for n in written), sorted(written - parsed)
    return written


def metric_values(text: str, name: str) -> list[float]:
    """Every value of ``name``'s series (failing when its family is not in the scrape)."""
    return [value for _, value in metric_series(text, name)]


def metric_series(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each of ``name``'s series whose labels include ``labels``, failing when
    ``name`` is not in the scrape. A family with samples must have one written as ``name``; a
    family without any (a labelled metric not touched yet) answers to its names."""
    found, out = False, []
    written: set[str] | None = None
    for family in text_string_to_metric_families(text):
        if name not in {family.name + suffix for suffix in SUFFIXES}:
            continue
        if family.samples:
            written = series_names(text) if written is None else written
            if name not in written:
                continue  # e.g. gateway_requests for gateway_requests_total's family
        found = True
        names = {name, name + "_total"} if family.type == "counter" and name == family.name else {name}
        out += [
            (s.labels, s.value)
            for s in family.samples
            if s.name in names and all(s.labels.get(k) == v for k, v in labels.items())
        ]
    assert found, f"metric {name} is not in the scrape at all"
    return out


def metric_sum(text: str, name: str, *, series: bool = False, **labels: str) -> float:
    """The sum of ``name``'s samples in ``text`` whose labels include ``labels``."""
    values = [value for _, value in metric_series(text, name, **labels)]
    assert values or not series, f"no series of {name} with labels {labels}"
    return float(sum(values))

"""One reader of Prometheus text for the tests (prometheus_client's own parser): the sum of a
metric's series whose labels include the ones asked for. A metric whose family is not in the
scrape at all fails the test, so a renamed or mistyped metric cannot read as 0 and pass an
`== 0` check; a family present without a matching series (a labelled counter not incremented
yet) sums to 0, or fails with ``series=True``."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SUFFIXES = ("", "_total", "_count", "_sum", "_bucket", "_created", "_info")


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def metric_values(text: str, name: str) -> list[float]:
    """Every value of ``name``'s series (failing when its family is not in the scrape)."""
    return [value for _, value in _series(text, name)]


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each of ``name``'s series, failing when its family is not in the scrape.
    The parser names a counter's samples ``<family>_total`` even where the scrape has no suffix
    (tritonserver's ``nv_inference_request_success``): such a sample is ``name``'s too."""
    found, out = False, []
    for family in text_string_to_metric_families(text):
        if name not in {family.name + suffix for suffix in SUFFIXES}:
            continue
        found = True
        names = {name, name + "_total"} if family.type == "counter" and name == family.name else {name}
        out += [(s.labels, s.value) for s in family.samples if s.name in names]
    assert found, f"metric {name} is not in the scrape at all"
    return out


def metric_sum(text: str, name: str, *, series: bool = False, **labels: str) -> float:
    """The sum of ``name``'s samples in ``text`` whose labels include ``labels``."""
    values = [value for have, value in _series(text, name) if all(have.get(k) == v for k, v in labels.items())]
    assert values or not series, f"no series of {name} with labels {labels}"
    return float(sum(values))

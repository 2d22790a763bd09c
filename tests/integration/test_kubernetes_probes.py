"""What deploy/kubernetes asks of the real servers: the gateway's probe paths answer, and the series the
HorizontalPodAutoscaler's adapter rule reads carry the label its selector names (model="text_encoder")
and move with traffic. The Triton pod's probes are the launcher's probe port, driven through a rollout
in tests/integration/test_replica_role.py."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
import yaml

from server.layout import ROOT
from tests.metrics_text import metric_sum
from tests.metrics_text import scrape as scrape_text

DEPLOY = ROOT / "deploy" / "kubernetes"


def manifests(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def probe_paths(deployment: str, container: str) -> dict[str, str]:
    (obj,) = [
        d
        for d in manifests(DEPLOY / "base" / f"{deployment}.yaml")
        if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment
    ]
    (c,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return {p: c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c}


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_gateway_probe_paths_answer(gateway):
    for probe, path in probe_paths("gateway", "gateway").items():
        assert status(gateway.url + path) == 200, f"{probe} {path}"


def adapter_rule() -> dict:
    (cm,) = manifests(DEPLOY / "prometheus-adapter" / "adapter-config.yaml")
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    return rule


def samples(text: str, name: str, model: str) -> float:
    return metric_sum(text, name, series=True, model=model)


def test_adapter_rule_series_carry_the_hpas_label_and_move(triton, http_client):
    rule = adapter_rule()
    names = sorted(set(re.findall(r"rate\((\w+)\{", rule["metricsQuery"])))
    (hpa,) = [d for d in manifests(DEPLOY / "base" / "autoscaling.yaml") if d["metadata"]["name"] == "triton"]
    model = hpa["spec"]["metrics"][0]["pods"]["metric"]["selector"]["matchLabels"]["model"]
    metrics_url = triton.triton.metrics_url  # tritonserver's own, behind the front door

    def scrape() -> dict[str, float]:
        text = scrape_text(metrics_url)
        return {n: samples(text, n, model) for n in names}

    before = scrape()
    texts = np.array([[b"kubernetes probe text %d" % i] for i in range(4)], dtype=object)
    inp = httpclient.InferInput("TEXT", list(texts.shape), "BYTES")
    inp.set_data_from_numpy(texts)
    http_client.infer("text_embedding", [inp], request_id="k8s-probe")
    after = scrape()
    assert after["nv_inference_request_success"] > before["nv_inference_request_success"]
    assert after["nv_inference_queue_duration_us"] >= before["nv_inference_queue_duration_us"]
    assert set(names) == {"nv_inference_queue_duration_us", "nv_inference_request_success", "nv_inference_request_failure"}

"""serve-cluster's Prometheus: its configuration (one scrape target per replica and gateway, the
rules files promtool accepts) and /usr/bin/prometheus as a child process (docs/monitoring.md)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from server.layout import ROOT
from server.supervisor import ChildProcess, NotReady, http_status

log = logging.getLogger(__name__)

PROMETHEUS_TEMPLATE = ROOT / "deploy" / "prometheus" / "prometheus.yml.template"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
DEFAULT_PROMETHEUS_PORT = 9090


class PrometheusError(RuntimeError):
    pass


def rule_files(rules_dir: Path, on_skip: Callable[[str], None] = log.warning) -> list[Path]:
    """The rules files in ``rules_dir`` that ``promtool check rules`` accepts (one broken file
    would stop Prometheus from starting at all: it is left out, and said so)."""
    files = sorted(Path(rules_dir).glob("*.yml")) + sorted(Path(rules_dir).glob("*.yaml"))
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").is_file() else None)
    if promtool is None:
        return files
    good = []
    for path in files:
        done = subprocess.run([promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True)
        if done.returncode == 0:
            good.append(path)
        else:
            on_skip(
                f"prometheus: {path.name} left out, promtool check rules failed: "
                f"{(done.stdout + done.stderr).strip().splitlines()[-1:]}"
            )
    return good


def render_prometheus(
    template: Path, replicas: Sequence, gateways: str | Sequence[str] | None, rules: Sequence[Path], scrape_interval_s: float
) -> str:
    """prometheus.yml from ``template``: job "triton" with one target per replica (label
    ``replica``), job "gateway" with one target per gateway address in ``gateways`` (label
    ``gateway``: its index; no job when there is none), the rules files ``rules``."""

    def target(address: str, labels: Mapping[str, str]) -> str:
        lab = ", ".join(f'{k}: "{v}"' for k, v in labels.items())
        return f'      - targets: ["{address}"]\n        labels: {{{lab}}}'

    triton = "\n".join(target(f"127.0.0.1:{r.metrics}", {"replica": str(r.index)}) for r in replicas)
    gateways = [gateways] if isinstance(gateways, str) else list(gateways or ())
    gateway_job = (
        (
            "  - job_name: gateway\n    metrics_path: /metrics\n    static_configs:\n"
            + "\n".join(target(address, {"gateway": str(i), "service": "openai-gateway"}) for i, address in enumerate(gateways))
        )
        if gateways
        else ""
    )
    values = {
        "SCRAPE_INTERVAL": f"{scrape_interval_s:g}s",
        "RULE_FILES": "\n".join(f'  - "{path}"' for path in rules) or "  []",
        "TRITON_TARGETS": triton,
        "GATEWAY_JOB": gateway_job,
    }
    text = template.read_text(encoding="utf-8")
    for key, value in values.items():
        text = text.replace("${" + key + "}", value)
    if "${" in text:
        raise PrometheusError(f"{template.name}: a placeholder was left unfilled")
    return text


class Prometheus:
    """/usr/bin/prometheus (Debian package prometheus) with its storage in the work folder."""

    def __init__(self, workdir: Path, port: int, host: str = "127.0.0.1"):
        self.workdir = Path(workdir)
        self.port = port
        self.host = host
        self.child = ChildProcess("prometheus", self.log_path, tie="SIGTERM")

    @property
    def process(self):
        return self.child.process

    @staticmethod
    def binary() -> str:
        found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").is_file() else None)
        if not found:
            raise PrometheusError("prometheus is not installed (Debian package prometheus; scripts/setup.sh)")
        return found

    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, config: str) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config, encoding="utf-8")
        self.child.start(
            [
                self.binary(),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={self.host}:{self.port}",
                "--storage.tsdb.retention.time=1d",
                "--web.enable-lifecycle",
            ]
        )
        return self

    def running(self) -> bool:
        return self.child.running()

    def wait_ready(self, timeout: float = 30.0) -> None:
        try:
            self.child.wait_ready(lambda: http_status(self.url + "/-/ready") == 200, timeout)
        except NotReady as exc:
            if exc.why == "exited":
                raise PrometheusError(f"prometheus exited with code {exc.returncode}:\n{self.log_tail()}") from None
            raise PrometheusError(f"prometheus not ready within {timeout:.0f} s:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 20) -> str:
        return self.child.log_tail(lines)

    def stop(self, timeout: float = 10.0) -> None:
        self.child.stop(timeout)

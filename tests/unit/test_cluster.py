"""serve-cluster's pieces without a server: Prometheus's configuration, rules, restart backoff,
a pool's replicas' options and the upstream list the supervision loop renders."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from server.deployment import Deployment, DeploymentOptions
from server.deployment_parts import DOWN, READY, Backoff, Gateway, Replica
from server.doors import Doors
from server.gateway import GatewayOptions
from server.process import ServerOptions
from server.prometheus import PROMETHEUS_TEMPLATE, render_prometheus, rule_files

PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)


def _replicas(n: int = 2) -> list[Replica]:
    return [
        Replica(
            i,
            ServerOptions(
                http_port=18000 + 10 * i, grpc_port=18001 + 10 * i, metrics_port=18002 + 10 * i, models=("text_embedding",)
            ),
        )
        for i in range(n)
    ]


def promtool_accepts(path: Path, config: str) -> None:
    """promtool check config passes on ``config`` (written to ``path``); the test's last check: a
    skip without promtool, which fails under make test (tests/conftest.py)."""
    if PROMTOOL is None:
        pytest.skip("promtool not installed (Debian package prometheus): the rendered config is not checked")
    path.write_text(config)
    done = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_scrapes_every_replica_and_the_gateway(tmp_path):
    rules = tmp_path / "serving.rules.yml"
    rules.write_text("groups: []\n")
    text = render_prometheus(PROMETHEUS_TEMPLATE, _replicas(), "127.0.0.1:8080", [rules], 5)
    assert "${" not in text and "scrape_interval: 5s" in text
    assert text.count('targets: ["127.0.0.1:') == 3 and '"127.0.0.1:18012"' in text and 'replica: "1"' in text
    assert "job_name: triton" in text and "job_name: gateway" in text and f'"{rules}"' in text
    no_gateway = render_prometheus(PROMETHEUS_TEMPLATE, _replicas(1), None, [], 2)
    assert "job_name: gateway" not in no_gateway and "rule_files:\n  []" in no_gateway
    for name, body in (("with.yml", text), ("without.yml", no_gateway)):
        promtool_accepts(tmp_path / name, body)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_a_broken_rules_file_is_left_out_not_fatal(tmp_path):
    (tmp_path / "good.yml").write_text("groups:\n  - name: g\n    rules:\n      - record: job:x:sum\n        expr: sum(up)\n")
    (tmp_path / "broken.yml").write_text("groups:\n  - name: g\n    rules:\n      - record: x\n        expr: sum(\n")
    skipped = []
    assert [p.name for p in rule_files(tmp_path, skipped.append)] == ["good.yml"]
    assert len(skipped) == 1 and "broken.yml" in skipped[0]


def test_restarts_back_off_boundedly():
    b = Backoff(first_s=1, max_s=30)
    assert [b.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_grpc_door_that_keeps_exiting_is_restarted_with_backoff(tmp_path):
    """At once after its first exit, then after the backoff's waits; a minute up resets the count."""

    class ExitedDoor:
        def __init__(self):
            self.starts = 0
            self.process = subprocess.Popen(["true"])
            self.process.wait()

        def start(self):
            self.starts += 1
            return self

        def log_tail(self, lines=10):
            return "bind: address in use"

    doors = Doors("127.0.0.1", (1, 2, 3), tmp_path, tmp_path, pool=False, health_dirs=[tmp_path], starting_file=tmp_path / "s")
    door = ExitedDoor()
    doors.grpc_door = door  # type: ignore[assignment]
    backoff = Backoff(first_s=1, max_s=30, reset_after_s=60)
    assert "exited (code 0)" in (doors.restart_grpc_door(100.0, backoff) or "") and door.starts == 1
    assert doors.restart_grpc_door(100.5, backoff) is None and door.starts == 1  # its first wait: 1 s
    assert doors.restart_grpc_door(101.0, backoff) is not None and door.starts == 2
    assert doors.restart_grpc_door(102.9, backoff) is None  # then 2 s
    assert doors.restart_grpc_door(103.0, backoff) is not None and door.starts == 3
    assert "bind: address in use" in (doors.grpc_door_exited() or "")
    door.process = subprocess.Popen(["sleep", "5"])  # this one stays up
    try:
        assert doors.restart_grpc_door(170.0, backoff) is None and doors.grpc_door_exited() is None
        door.process.kill()
        door.process.wait()
        assert doors.restart_grpc_door(170.1, backoff) is not None and door.starts == 4  # the count started again
    finally:
        door.process.kill()


def test_replicas_get_their_own_ports_and_folders_and_the_shared_l2(tmp_path):
    pool = Deployment(
        DeploymentOptions(replicas=3, pool=True, workdir=tmp_path, models=("text_embedding",), redis_url="redis://127.0.0.1:1/0")
    )
    options = [r.options for r in pool.replicas]
    assert len({o.workdir for o in options}) == 3 and len({o.http_port for o in options}) == 3
    assert len({o.health_dir for o in options}) == 3
    assert all(o.host == "127.0.0.1" and o.http_port not in (8000, 8001, 8002) for o in options)  # behind the front door
    assert all(o.env["EMBEDDING_CACHE_L2_REDIS_URL"] == "redis://127.0.0.1:1/0" for o in options)
    # One tritonserver behind its doors: its own ports on loopback, in the deployment's folder.
    (one,) = Deployment(DeploymentOptions(workdir=tmp_path, triton_http_port=1234)).replicas
    assert one.options.workdir == tmp_path and one.options.http_port == 1234 and one.options.host == "127.0.0.1"
    (bare,) = Deployment(DeploymentOptions(workdir=tmp_path, front_door=False, host="0.0.0.0")).replicas
    assert (bare.options.host, bare.options.http_port) == ("0.0.0.0", 8000)
    with pytest.raises(Exception, match="replicas must be"):
        DeploymentOptions(replicas=0)
    with pytest.raises(Exception, match="several only in a pool"):
        DeploymentOptions(replicas=2)


def test_a_replica_is_listed_once_ready_and_stays_listed_while_it_restarts():
    replicas = _replicas(2)
    replicas[0].state, replicas[1].state = READY, DOWN
    replicas[0].in_door = True
    # Before its first readiness a replica gets no traffic.
    assert [u.down for u in (r.upstream() for r in replicas)] == [False, True]
    replicas[1].state = "starting"
    assert replicas[1].upstream().down
    # A ready replica that dies stays listed (its ports refuse; nginx sends on without a reload
    # that would close clients' keep-alive connections); the supervisor takes one out only when
    # it is alive but fails readiness (in_door False).
    replicas[0].state = DOWN
    assert not replicas[0].upstream().down
    replicas[0].in_door = False
    assert replicas[0].upstream().down


def test_the_options_table_of_docs_cluster_matches_the_code():
    import re

    from server.cluster_cli import build_parser
    from server.layout import ROOT

    rows = [line for line in (ROOT / "docs" / "cluster.md").read_text().splitlines() if line.startswith("| `--")]
    documented = {flag for row in rows for flag in re.findall(r"--[a-z][a-z0-9-]*", row.split("|")[1])}
    actual = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    assert len(actual) > 10 and documented == actual, (sorted(documented - actual), sorted(actual - documented))


def test_prometheus_scrapes_each_gateway_and_the_front_door_lists_only_ready_ones(tmp_path):
    text = render_prometheus(PROMETHEUS_TEMPLATE, _replicas(), ["127.0.0.1:19000", "127.0.0.1:19001"], [], 5)
    gateway_job = text.split("job_name: gateway", 1)[1]
    assert gateway_job.count("targets:") == 2 and 'gateway: "0"' in gateway_job and 'gateway: "1"' in gateway_job
    assert '["127.0.0.1:19001"]' in gateway_job and "job_name: gateway" not in render_prometheus(
        PROMETHEUS_TEMPLATE, _replicas(), [], [], 5
    )
    gateway = GatewayOptions("", port=18080, env={"GATEWAY_MAX_BODY_MB": "2"})
    cluster = Deployment(DeploymentOptions(replicas=1, pool=True, workdir=tmp_path, gateway=gateway, gateways=2))
    cluster.replicas = _replicas(1)
    cluster.gateways = [Gateway(0, 19000, state=READY), Gateway(1, 19001, state="starting")]
    door = cluster.gateway_door()
    assert door is not None and door.port == 18080 and door.max_body_bytes == 2 << 20
    assert [(s.port, s.down) for s in door.servers] == [(19000, False), (19001, True)]
    assert cluster.gateway_url == "http://127.0.0.1:18080" and cluster.loop.wanted() == (False, True, False)
    doors = Doors("127.0.0.1", (8000, 8001, 8002), tmp_path, tmp_path, pool=True, health_dirs=[], starting_file=tmp_path / "s")
    assert doors.ports([r.upstream() for r in cluster.replicas], door).gateway == door
    none = Deployment(DeploymentOptions(replicas=1, pool=True, workdir=tmp_path, gateway=gateway, gateways=0))
    assert none.gateway_door() is None and none.gateway_url is None and none.loop.wanted() == (False,)
    with pytest.raises(Exception, match="gateways must be"):
        DeploymentOptions(gateways=-1)
    promtool_accepts(tmp_path / "p.yml", text)

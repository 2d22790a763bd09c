"""The front door's generated nginx configuration and limits, and the models' shape check."""

import json
import shutil

import pytest

from contract.errors import InputError
from python_backends.shim import check_shape
from server.deployment import Deployment, DeploymentOptions
from server.frontdoor import FrontDoor, FrontDoorPorts, class_limits, limits_module, model_limits, render
from server.layout import ROOT, prepare

PORTS = FrontDoorPorts("127.0.0.1", 8000, 8001, 8002, "127.0.0.1", 18000, 18001, 18002)


def test_limits_come_from_the_configs():
    limits = model_limits(ROOT / "model_repository")
    text = limits["text_embedding"]
    assert text["max_batch_size"] == 64
    assert text["inputs"]["TEXT"] == {"datatype": "BYTES", "dims": [1], "max_elements": 64}
    assert limits["text_encoder"]["inputs"]["input_ids"]["max_elements"] == 0  # variable length: global bound
    module = limits_module(ROOT / "model_repository", 1024)
    assert module.startswith("//") and json.loads(module.split("export default ", 1)[1].rstrip(";\n"))["max_elements"] == 1024


def test_render_fills_every_placeholder_and_keeps_nginx_variables(tmp_path):
    conf = render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path=tmp_path / "m.so")
    assert "${" not in conf
    assert "listen 127.0.0.1:8001 http2;" in conf and "server 127.0.0.1:18000;" in conf
    assert "(?<frontdoor_model>" in conf and "limit_except GET" in conf
    assert f"client_body_temp_path {tmp_path}/client_body;" in conf


def test_each_class_entry_gets_its_admission_rows_as_in_flight_limit(tmp_path):
    from python_backends.admission.classes import CACHED_ENTRIES

    limits = class_limits(ROOT / "model_repository")
    assert {m: c for m, (c, _) in limits.items()} == {m: c for c, m in CACHED_ENTRIES.items()}
    assert limits["text_embedding_cached_bulk"] == ("bulk", 16)
    conf = render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path="m.so", limits=limits)
    for i, (model, (cls, rows)) in enumerate(sorted(limits.items())):
        assert f"~^/v2/models/{model}(/versions/[0-9]+)?/infer$ 1;" in conf
        assert f"limit_conn inflight_{i} {rows};  # {model}" in conf
        assert f"~^/v2/models/{model}(/versions/[0-9]+)?/infer$ {cls};" in conf
    assert "limit_conn_status 503;" in conf and "error_page 503 = @class_full;" in conf
    # no class entries: no limit lines
    assert "limit_conn inflight" not in render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path="m.so")


def test_launcher_keeps_its_error_log_in_the_work_folder(tmp_path):
    conf = render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path=tmp_path / "m.so")
    assert f"error_log {tmp_path}/nginx-error.log warn;" in conf
    assert "error_log stderr warn;" in render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path="m.so", error_log="stderr")


def test_render_command_writes_the_compose_bundle(tmp_path):
    from server import frontdoor

    out = tmp_path / "out"
    assert frontdoor.main(["render", "--out", str(out), "--max-body-mb", "2", "--workers", "3"]) == 0
    conf = (out / "nginx.conf").read_text()
    assert "${" not in conf and "worker_processes 3;" in conf and "client_max_body_size 2097152;" in conf
    assert f"pid {frontdoor.COMPOSE_WORKDIR}/nginx.pid;" in conf
    # the check itself is the launcher's, byte for byte; its limits say the body bound
    assert (out / "js" / "infer_check.js").read_bytes() == (ROOT / "deploy/frontdoor/infer_check.js").read_bytes()
    limits = json.loads((out / "js" / "limits.js").read_text().split("export default ", 1)[1].rstrip(";\n"))
    assert limits["max_body_bytes"] == 2 << 20 and "text_embedding" in limits["models"]
    with pytest.raises(SystemExit):
        frontdoor.main(["render"])  # --out is required


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/setup.sh installs it)")
def test_generated_configuration_passes_nginx_t(tmp_path):
    FrontDoor(PORTS, tmp_path, ROOT / "model_repository", max_body_bytes=1 << 20).check()


def test_triton_listens_internally_behind_the_front_door(tmp_path):
    options = DeploymentOptions.with_free_ports(
        workdir=tmp_path, triton_http_port=1234, triton_grpc_port=1235, triton_metrics_port=1236, repository_token="t"
    )
    deployment = Deployment(options)
    server = deployment.triton  # the tritonserver process only: the doors are the deployment's
    server.layout = prepare(tmp_path)
    cmd = server.command()
    assert "--http-port=1234" in cmd and "--http-address=127.0.0.1" in cmd and "--grpc-port=1235" in cmd
    assert deployment.http_url.endswith(f":{options.http_port}") and deployment.triton_http_url.endswith(":1234")
    assert any(a.startswith("--http-restricted-api=shared-memory,trace,logging:") for a in cmd)
    assert f"--exit-timeout-secs={int(options.drain_timeout)}" in cmd
    assert not hasattr(server, "front_door") and deployment.front_door is None  # made at start


@pytest.mark.parametrize(
    "shape, dims, mbs, size, ok",
    [
        ([2, 1], [1], 64, None, True),
        ([1], [1], 64, None, False),  # a batch of 2^40 arrives with the batch axis gone
        ([0, 1], [1], 64, None, False),
        ([65, 1], [1], 64, None, False),
        ([2, 7], [-1], 64, 14, True),
        ([2, 7], [-1], 64, 13, False),
        ([2, 3], [1], 64, None, False),
        ([3], [-1], 0, 3, True),
        ([1, 3], [-1], 0, None, False),
    ],
)
def test_check_shape(shape, dims, mbs, size, ok):
    if ok:
        check_shape("T", shape, dims, mbs, size=size)
    else:
        with pytest.raises(InputError, match="^T: "):
            check_shape("T", shape, dims, mbs, size=size)


def _cluster_ports(down=(False, False)):
    from server.frontdoor import Upstream

    return FrontDoorPorts.cluster(
        "127.0.0.1",
        8000,
        8001,
        8002,
        [Upstream("127.0.0.1", 18000 + 10 * i, 18001 + 10 * i, 18002 + 10 * i, down=d) for i, d in enumerate(down)],
    )


def test_one_upstream_server_renders_as_before_and_a_cluster_lists_every_replica(tmp_path):
    single = render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path="m.so")
    assert "server 127.0.0.1:18000;" in single and "max_fails=" not in single
    conf = render(_cluster_ports(down=(False, True)), tmp_path, tmp_path / "js", 4096, js_module_path="m.so")
    assert "server 127.0.0.1:18000 max_fails=2 fail_timeout=5s;" in conf
    assert "server 127.0.0.1:18010 max_fails=2 fail_timeout=5s down;" in conf  # not ready: no traffic
    assert "server 127.0.0.1:18011 max_fails=2 fail_timeout=5s down;" in conf
    assert "server 127.0.0.1:18012 max_fails=2 fail_timeout=5s backup down;" in conf  # metrics: one replica's
    # inference is retried on the next replica, POSTs included; other locations only as nginx deems idempotent
    # (@triton, its plain resend and the two healing retries, @triton_stream, a decoupled model's whole answer)
    # (404: a replica restarted during a rollout that has not loaded a deferred model yet)
    assert conf.count("proxy_next_upstream error timeout http_502 http_404 non_idempotent;") == 6
    assert "proxy_next_upstream error timeout http_502;" in conf
    # the repository API goes to tritonserver with one server, to the cluster's repository door with several
    assert "location /v2/repository/ {\n            proxy_pass http://triton_http;" in single
    ports = _cluster_ports()
    ports.repository_door_port = 19999
    door = render(ports, tmp_path, tmp_path / "js", 4096, js_module_path="m.so")
    assert "location /v2/repository/ {\n            proxy_pass http://127.0.0.1:19999;" in door
    assert "location /v2/cluster/ {\n            proxy_pass http://127.0.0.1:19999;" in door
    assert "grpc_next_upstream error timeout http_502 non_idempotent;" in conf
    assert "proxy_connect_timeout 1s;" in conf and "proxy_next_upstream_tries 3;" in conf
    assert "idempotent" in (ROOT / "deploy/frontdoor/nginx.conf.template").read_text().split("proxy_connect_timeout")[0]


def test_class_limits_scale_with_the_replicas(tmp_path):
    limits = {"text_embedding_cached": ("default", 64)}
    one = render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path="m.so", limits=limits)
    two = render(_cluster_ports(), tmp_path, tmp_path / "js", 4096, js_module_path="m.so", limits=limits)
    assert "limit_conn inflight_0 64;" in one and "limit_conn inflight_0 128;" in two


def test_render_command_takes_several_upstreams(tmp_path, capsys):
    from server import frontdoor

    out = tmp_path / "out"
    assert frontdoor.main(["render", "--out", str(out), "--upstream", "triton-0", "--upstream", "triton-1:9000:9001:9002"]) == 0
    conf = (out / "nginx.conf").read_text()
    assert "server triton-0:8000 max_fails=2 fail_timeout=5s;" in conf and "server triton-1:9001 max_fails=2" in conf
    assert "upstream triton-0:8000, triton-1:9000" in capsys.readouterr().out
    assert frontdoor.main(["render", "--out", str(tmp_path / "d")]) == 0  # default: compose's two replicas
    default = (tmp_path / "d" / "nginx.conf").read_text()
    assert "server triton-upstream-1:8000 max_fails=2" in default and "server triton-upstream-2:8000 max_fails=2" in default
    with pytest.raises(SystemExit):
        frontdoor.main(["render", "--out", str(out), "--upstream", "host:1:2"])


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/setup.sh installs it)")
def test_cluster_configuration_passes_nginx_t_even_with_every_replica_down(tmp_path):
    FrontDoor(_cluster_ports(down=(True, True)), tmp_path, ROOT / "model_repository", max_body_bytes=1 << 20).check()


def _gateway_ports(n: int, down=()):
    from server.frontdoor import GatewayDoor, GatewayServer, Upstream

    servers = tuple(GatewayServer("127.0.0.1", 19000 + i, down=i in down) for i in range(n))
    return FrontDoorPorts.cluster(
        "127.0.0.1",
        8000,
        8001,
        8002,
        [Upstream("127.0.0.1", 18000, 18001, 18002)],
        GatewayDoor(8080, servers, 1 << 20) if n else None,
    )


def test_the_gateway_server_block_lists_every_gateway_and_is_absent_without_one(tmp_path):
    conf = render(_gateway_ports(3, down=(1,)), tmp_path, tmp_path / "js", 4096, js_module_path="m.so")
    block = conf.split("upstream openai_gateway {", 1)[1].split("}", 1)[0]
    assert [line.strip() for line in block.strip().splitlines()] == [
        "server 127.0.0.1:19000 max_fails=2 fail_timeout=5s;",
        "server 127.0.0.1:19001 max_fails=2 fail_timeout=5s down;",  # not ready: no traffic
        "server 127.0.0.1:19002 max_fails=2 fail_timeout=5s;",
        "keepalive 64;",
    ]
    assert "listen 127.0.0.1:8080;" in conf and "client_max_body_size 1048576;" in conf
    # SSE unbuffered; POSTs retried before the first byte; 503 and 429 reach the client
    assert (
        "location ~ ^/v1/(chat/completions|completions)$ {\n            proxy_pass http://openai_gateway;\n"
        "            proxy_next_upstream error timeout http_502 non_idempotent;\n            proxy_buffering off;" in conf
    )
    assert (
        "location = /v1/embeddings {" in conf
        and conf.count("http_502 non_idempotent;") == 3
        and conf.count("http_404 non_idempotent;") == 6
    )  # 3 gateway, 6 Triton
    directives = [line for line in conf.splitlines() if "_next_upstream " in line and "#" not in line]
    assert directives and not any("http_503" in line or "http_429" in line for line in directives)
    for conf in (
        render(_gateway_ports(0), tmp_path, tmp_path / "js", 4096, js_module_path="m.so"),
        render(PORTS, tmp_path, tmp_path / "js", 4096, js_module_path="m.so"),
    ):
        assert "openai_gateway" not in conf and "8080" not in conf and "${" not in conf


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/setup.sh installs it)")
def test_the_gateway_configuration_passes_nginx_t(tmp_path):
    for n, down in ((2, ()), (1, ()), (2, (0, 1))):
        FrontDoor(
            _gateway_ports(n, down), tmp_path / f"g{n}{len(down)}", ROOT / "model_repository", max_body_bytes=1 << 20
        ).check()


def test_render_puts_the_grpc_listener_where_a_grpc_door_forwards(tmp_path):
    """Kubernetes: the export Job renders nginx's gRPC listener on the pod's loopback (the gRPC
    door sidecar holds 8001); without --grpc-listen it is LISTEN:8001 (docker-compose)."""
    from server.frontdoor import main

    main(
        [
            "render",
            "--out",
            str(tmp_path / "k8s"),
            "--upstream",
            "127.0.0.1:8010:8011:8012",
            "--listen",
            "0.0.0.0",
            "--grpc-listen",
            "127.0.0.1:8021",
        ]
    )
    conf = (tmp_path / "k8s" / "nginx.conf").read_text()
    assert "listen 127.0.0.1:8021 http2;" in conf and "listen 0.0.0.0:8000;" in conf
    main(["render", "--out", str(tmp_path / "compose")])
    assert "listen 0.0.0.0:8001 http2;" in (tmp_path / "compose" / "nginx.conf").read_text()
    with pytest.raises(SystemExit):
        main(["render", "--out", str(tmp_path / "bad"), "--grpc-listen", "8021"])


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/setup.sh installs it)")
def test_a_configuration_with_the_stream_door_passes_nginx_t(tmp_path):
    """generate_stream to the gRPC door's stream listener, and the internal listener it calls back."""
    import dataclasses

    ports = dataclasses.replace(PORTS, stream_door="127.0.0.1:18005", stream_upstream_listen="127.0.0.1:18006")
    door = FrontDoor(ports, tmp_path, ROOT / "model_repository", max_body_bytes=1 << 20)
    door.check()
    conf = door.conf_path.read_text()
    assert "proxy_pass http://127.0.0.1:18005;" in conf and "listen 127.0.0.1:18006;" in conf

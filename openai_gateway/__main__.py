"""``python -m openai_gateway``: serve the OpenAI-compatible API in front of Triton (uvicorn)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from openai_gateway import settings as settings_module

GC_THRESHOLDS = (int(os.environ.get("GATEWAY_GC_GEN0", "50000")), 20, 100)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, read the keys, serve until SIGTERM; the exit status."""
    p = argparse.ArgumentParser(prog="python -m openai_gateway", description=__doc__)
    settings_module.add_arguments(p)
    p.add_argument("--log-level", default=os.environ.get("GATEWAY_LOG_LEVEL", "info"))
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(os.environ.get("GATEWAY_DRAIN_TIMEOUT", "30")),
        help="on SIGTERM: seconds for in-flight requests to finish (default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=int(os.environ.get("GATEWAY_MAX_CONNECTIONS", "1024")),
        help="connections and requests in flight at once; beyond it uvicorn answers 503 (default 1024)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings_module.from_args(args)

    import uvicorn

    from openai_gateway.app import create_app
    from openai_gateway.auth import ApiKeys, ensure_key_file

    try:
        if settings.api_keys:
            keys, source = ApiKeys(settings.api_keys), "$GATEWAY_API_KEYS"
        else:
            keys, source = ApiKeys(ensure_key_file(settings.api_key_file)), str(settings.api_key_file)
    except (OSError, ValueError) as exc:  # a key file others can read, an empty one, a short key
        print(f"python -m openai_gateway: refusing to start: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, keys)
    logging.getLogger("openai_gateway").info(
        "listening on http://%s:%d, Triton gRPC at %s, %d API key(s) from %s, rate limit %s",
        settings.host,
        settings.port,
        settings.triton_url,
        len(keys),
        source,
        f"{settings.rate_limit_rps:g}/s burst {settings.rate_limit_burst} per key" if settings.rate_limit_rps > 0 else "off",
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_config=None,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.drain_timeout,
        timeout_keep_alive=30,
        limit_concurrency=args.max_connections,
        server_header=False,
    )
    # The objects alive at start (modules, the app, the tokenizer) are never garbage: out of
    # the collector's sight, and its young generation collected less often, so a full
    # collection does not stall every request in flight (docs/openai-gateway.md).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())

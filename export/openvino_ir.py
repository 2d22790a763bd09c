"""The OpenVINO models of ``text_generation``'s ``ov_*`` variants, made from the exported GGUFs.

OpenVINO GenAI builds its graph of a GGUF itself (its GGUF reader: llama, Qwen2 and Qwen3
architectures) and, asked to, saves it as ``openvino_model.xml`` / ``.bin`` beside the GGUF
(``enable_save_ov_model``). That graph is what the runtime loads (python_backends/generation/
openvino_runtime.py), turned into the paged form at load. It is built in a child process: the
pipeline GenAI loads on the way holds the weights and a KV cache the export does not need.

``ov_int4_f16`` also gets ``openvino_model_int4.xml`` beside it: the same graph with 4-bit products
(``quantize_int4``), saved so that the served stub maps it from disk as it maps the F16 one.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from python_backends.generation.llama_cpp_runtime import gguf_file
from python_backends.generation.openvino_runtime import (
    INT4_IR_FILE,
    IR_FILE,
    OV_INT4_PRECISIONS,
    OV_PRECISIONS,
    ir_dir,
    quantize_int4,
)

log = logging.getLogger(__name__)

_CHILD = """
import sys
import openvino_genai
openvino_genai.LLMPipeline(sys.argv[1], "CPU", enable_save_ov_model=True)
"""


class OpenVINOExportError(RuntimeError):
    pass


def make_ir(model_dir: Path, precision: str, say=log.info) -> Path:
    """``<model_dir>/openvino-<type>/openvino_model.xml`` from the variant's GGUF (made first by
    export.llama_cpp.make_ggufs): OpenVINO GenAI's graph of it."""
    gguf = model_dir / gguf_file(f"llama_{OV_PRECISIONS[precision]}")
    if not gguf.is_file():
        raise OpenVINOExportError(f"{gguf} is missing: make the GGUFs first (python -m export.llama_cpp gguf)")
    target = ir_dir(model_dir, precision)
    say(f"text_generation: OpenVINO GenAI's graph of {gguf.name} -> {target.name}/{IR_FILE}")
    with tempfile.TemporaryDirectory(prefix="ov-", dir=model_dir.parent) as tmp:
        link = Path(tmp) / gguf.name
        link.symlink_to(gguf.resolve())
        done = subprocess.run([sys.executable, "-c", _CHILD, str(link)], capture_output=True, text=True, timeout=900)
        xml = Path(tmp) / IR_FILE
        if done.returncode != 0 or not xml.is_file() or not xml.with_suffix(".bin").is_file():
            raise OpenVINOExportError(f"OpenVINO GenAI did not save a model of {gguf.name}:\n{done.stderr[-3000:]}")
        staged = Path(tmp) / "ir"
        staged.mkdir()
        for path in (xml, xml.with_suffix(".bin")):
            shutil.move(str(path), staged / path.name)
            (staged / path.name).chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        staged.replace(target)
    return target / IR_FILE


def make_int4_ir(model_dir: Path, precision: str, say=log.info) -> Path:
    """``openvino_model_int4.xml`` beside the variant's F16 graph (made first by :func:`make_ir`): every
    layer's product as 4-bit blocks of 32, the head as 8-bit blocks (openvino_runtime.quantize_int4)."""
    import openvino as ov

    if precision not in OV_INT4_PRECISIONS:
        raise OpenVINOExportError(f"{precision} has no 4-bit graph")
    source = ir_dir(model_dir, precision) / IR_FILE
    target = source.with_name(INT4_IR_FILE)
    model = ov.Core().read_model(str(source))
    n = quantize_int4(model)
    staged = target.with_name(f".{target.name}")
    ov.save_model(model, str(staged), compress_to_fp16=False)
    staged.with_suffix(".bin").replace(target.with_suffix(".bin"))
    staged.replace(target)
    say(f"text_generation: {precision}: {n} products as 4-bit blocks -> {target.parent.name}/{target.name}")
    return target

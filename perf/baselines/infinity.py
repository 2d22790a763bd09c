"""infinity-emb, the dedicated embedding server a user would otherwise run, as the embeddings peer.

Installed on first use into its own git-ignored virtualenv (``.cache/peers/infinity-<version>/``; its
pins conflict with the project's), with the optimum / transformers versions its ONNX path works with.
It runs its ``optimum`` engine (ONNX Runtime) on a dynamically quantized INT8 file, as it prefers on a
CPU: the packaged all-MiniLM-L6-v2 exported as optimum's feature extraction (``last_hidden_state``;
infinity pools), quantized per channel for this CPU, served from inside that folder (``--model-id .``:
optimum refuses a local ONNX path unless it is relative).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.0.78"
PINS = (f"infinity-emb[server,optimum]=={VERSION}", "torch==2.13.0", "optimum==1.24.0", "transformers==4.48.3")
ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".cache" / "peers" / f"infinity-{VERSION}"
VENV = HOME / "venv"
MODEL = HOME / "all-MiniLM-L6-v2"
HF_HOME = HOME / "hf-home"  # where infinity keeps its ONNX Runtime-optimised copy of the model
SERVED_NAME = "text_embedding"


class InfinityError(RuntimeError):
    pass


def ensure_venv(say=print) -> Path:
    """The peer's virtualenv, installed first if missing (a minute or two from PyPI)."""
    stamp = VENV / ".installed"
    if stamp.is_file() and stamp.read_text() == "\n".join(PINS):
        return VENV
    shutil.rmtree(VENV, ignore_errors=True)
    say(f"infinity-emb: installing {', '.join(PINS)} into {VENV.relative_to(ROOT)}")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        raise InfinityError(f"pip install of infinity-emb failed: {done.stderr.strip()[-2000:]}")
    stamp.write_text("\n".join(PINS))
    return VENV


def ensure_model(say=print) -> Path:
    """The peer's model folder (made once): tokenizer and config, ``model.onnx`` and ``model_quantized.onnx``."""
    from python_backends.generation.linear import cpu_features

    flags = cpu_features()  # optimum's AutoQuantizationConfig for this CPU
    target = "avx512_vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags else "avx2"
    stamp = MODEL / ".prepared"
    if stamp.is_file() and stamp.read_text() == f"{target} per channel":
        return MODEL
    from export.reference import model_dir

    ensure_venv(say)
    source = model_dir()
    staged = MODEL.with_name(f".{MODEL.name}")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(source, staged, ignore=shutil.ignore_patterns("*.safetensors"))  # tokenizer, configs, pooling
    say(f"infinity-emb: exporting {source.name} to ONNX (last_hidden_state) and quantizing it (optimum, {target})")
    _export_onnx(staged / "model.onnx")
    command = [str(VENV / "bin" / "python"), "-m", "perf.baselines.infinity", str(staged), target]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise InfinityError(f"the peer's INT8 quantization failed: {done.stderr.strip()[-2000:]}")
    (staged / ".prepared").write_text(f"{target} per channel")
    shutil.rmtree(MODEL, ignore_errors=True)
    shutil.rmtree(HF_HOME, ignore_errors=True)  # infinity's optimised copy of the previous file
    staged.replace(MODEL)
    return MODEL


def _export_onnx(path: Path) -> None:
    """transformers' BertModel as optimum's feature-extraction export has it: input_ids, attention_mask,
    token_type_ids -> last_hidden_state (the legacy exporter, as the project's own export)."""
    import torch

    from export.reference import load_torch_model

    class Encoder(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.int64)
    axes = {0: "batch_size", 1: "sequence_length"}
    torch.onnx.export(
        Encoder(load_torch_model()).eval(),
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        str(path),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes, "last_hidden_state": axes},
        opset_version=17,
        dynamo=False,
    )


def _quantize(folder: str, quantization: str) -> None:
    """In the peer's virtualenv: optimum's dynamic INT8 quantizer -> ``model_quantized.onnx``."""
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    # Per channel: per tensor, the vectors move to cosine 0.93-0.96 of FP32's on this model (0.99 per channel).
    config = getattr(AutoQuantizationConfig, quantization)(is_static=False, per_channel=True)
    ORTQuantizer.from_pretrained(folder, file_name="model.onnx").quantize(save_dir=folder, quantization_config=config)


class InfinityServer:
    """``infinity_emb v2`` on 127.0.0.1:``port``, its ``optimum`` engine on the prepared folder, the
    model served as ``text_embedding``; ``batch_size`` is its dynamic batch (its default, 32).
    ``quantized``: the INT8 file, what infinity picks on a CPU; False: ``model.onnx`` (FP32,
    ``--onnx-do-not-prefer-quantized``)."""

    def __init__(self, port: int, log_path: Path, batch_size: int = 32, quantized: bool = True, say=print):
        from server.supervisor import ChildProcess

        self.port, self.log_path, self.batch_size, self.quantized = port, log_path, batch_size, quantized
        self.url = f"http://127.0.0.1:{port}"
        self.model = ensure_model(say)
        self.child = ChildProcess(f"infinity-{port}", log_path, grace=15)

    def start(self, timeout: float = 180.0) -> InfinityServer:
        from server.supervisor import NotReady, http_status

        args = [str(VENV / "bin" / "infinity_emb"), "v2", "--model-id", ".", "--served-model-name", SERVED_NAME]
        args += ["--engine", "optimum", "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--batch-size", str(self.batch_size), "--log-level", "warning", "--no-vector-disk-cache"]
        args += ["--pooling-method", "mean"]  # the model's (1_Pooling); "auto" is CLS on the optimum engine
        if not self.quantized:
            args.append("--onnx-do-not-prefer-quantized")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(HF_HOME), "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        self.child.start(args, env=env, cwd=self.model)
        try:
            self.child.wait_ready(lambda: http_status(f"{self.url}/health") == 200, timeout, interval=0.5)
        except NotReady as exc:
            self.stop()
            raise InfinityError(f"infinity_emb {exc} before answering /health; see {self.log_path}") from None
        return self

    def stop(self) -> None:
        self.child.stop()


# In the peer's virtualenv, run by ensure_model: python -m perf.baselines.infinity FOLDER TARGET
if __name__ == "__main__":
    _quantize(*sys.argv[1:3])

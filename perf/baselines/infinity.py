"""infinity-emb, the dedicated embedding server a user would otherwise run, as the embeddings peer.

Installed on first use into its own git-ignored virtualenv (``.cache/peers/infinity-<version>/``:
its pins conflict with the project's), with the CPU build of torch the project already uses, and
the optimum / transformers versions its ONNX path works with (optimum 2 dropped the optimisation
options it passes, and its BetterTransformer check refuses transformers >= 4.49).

Its best CPU setting is its ``optimum`` engine (ONNX Runtime) on a dynamically quantized INT8
file: on a CPU it prefers a file named ``*quantize*``, and optimises the graph with ONNX Runtime's
transformer fusions at start (cached under its own HF home). The model folder is made once from
the same packaged all-MiniLM-L6-v2 the project exports (``export/reference.py``): the BERT encoder
to ONNX as optimum's feature-extraction export has it (``last_hidden_state``: infinity pools in
Python; torch's legacy exporter, run here), then optimum's dynamic INT8 quantizer with
the configuration for this CPU (AVX-512 VNNI, AVX-512 or AVX2), per channel. The server runs from inside that folder (``--model-id .``): infinity names a local
folder's ONNX file by its path, which optimum then refuses unless it is relative.

    python -m perf.baselines.infinity prepare   # the virtualenv and the model folder
    python -m perf.baselines.infinity serve --port 7997
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

VERSION = "0.0.78"
PINS = (f"infinity-emb[server,optimum]=={VERSION}", "torch==2.13.0", "optimum==1.24.0", "transformers==4.48.3")
ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".cache" / "peers" / f"infinity-{VERSION}"
VENV = HOME / "venv"
MODEL = HOME / "all-MiniLM-L6-v2"
HF_HOME = HOME / "hf-home"  # where infinity keeps its ONNX Runtime-optimised copy of the model
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling",
)
SERVED_NAME = "text_embedding"


class InfinityError(RuntimeError):
    pass


def _python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv(say=print) -> Path:
    """The peer's virtualenv, installed first if missing (a minute or two from PyPI)."""
    stamp = VENV / ".installed"
    if stamp.is_file() and stamp.read_text() == "\n".join(PINS):
        return VENV
    shutil.rmtree(VENV, ignore_errors=True)
    say(f"infinity-emb: installing {', '.join(PINS)} into {VENV.relative_to(ROOT)}")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    done = subprocess.run(
        [str(_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise InfinityError(f"pip install of infinity-emb failed: {done.stderr.strip()[-2000:]}")
    stamp.write_text("\n".join(PINS))
    return VENV


def quantization_target(flags: frozenset[str]) -> str:
    """optimum's AutoQuantizationConfig for this CPU's flags (python_backends.generation.linear.cpu_features)."""
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2"


def ensure_model(say=print) -> Path:
    """The peer's model folder (made once): tokenizer and config, ``model.onnx`` and ``model_quantized.onnx``."""
    from python_backends.generation.linear import cpu_features

    target = quantization_target(cpu_features())
    stamp = MODEL / ".prepared"
    if stamp.is_file() and stamp.read_text() == f"{target} per channel":
        return MODEL
    from export.reference import model_dir

    ensure_venv(say)
    source = model_dir()
    staged = MODEL.with_name(f".{MODEL.name}")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for name in MODEL_FILES:
        path = source / name
        if path.is_dir():
            shutil.copytree(path, staged / name)
        elif path.is_file():
            shutil.copy2(path, staged / name)
    say(f"infinity-emb: exporting {source.name} to ONNX (last_hidden_state) and quantizing it (optimum, {target})")
    _export_onnx(staged / "model.onnx")
    done = subprocess.run(
        [str(_python()), "-m", "perf.baselines.infinity", "_quantize", str(staged), target],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
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
        self.port, self.log_path, self.batch_size, self.quantized = port, log_path, batch_size, quantized
        self.url = f"http://127.0.0.1:{port}"
        self.model = ensure_model(say)
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> InfinityServer:
        args = [str(VENV / "bin" / "infinity_emb"), "v2", "--model-id", ".", "--served-model-name", SERVED_NAME]
        args += ["--engine", "optimum", "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--batch-size", str(self.batch_size), "--log-level", "warning", "--no-vector-disk-cache"]
        args += ["--pooling-method", "mean"]  # the model's (1_Pooling); "auto" is CLS on the optimum engine
        if not self.quantized:
            args.append("--onnx-do-not-prefer-quantized")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(HF_HOME), "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(args, cwd=self.model, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise InfinityError(f"infinity_emb exited with {self._proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise InfinityError(f"infinity_emb did not answer /health within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._proc = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.baselines.infinity", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="install the virtualenv and make the model folder")
    serve = sub.add_parser("serve", help="run the server until interrupted")
    serve.add_argument("--port", type=int, default=7997)
    quantize = sub.add_parser("_quantize")  # run by ensure_model inside the peer's virtualenv
    quantize.add_argument("folder")
    quantize.add_argument("quantization")
    args = p.parse_args(argv)
    if args.command == "_quantize":
        _quantize(args.folder, args.quantization)
    elif args.command == "prepare":
        print(ensure_model())
    else:
        server = InfinityServer(args.port, HOME / "serve.log").start()
        print(f"infinity-emb on {server.url} (log {server.log_path})")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

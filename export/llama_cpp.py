"""llama.cpp for this CPU, and the GGUF files ``text_generation``'s ``llama_*`` variants serve.

llama.cpp is built from the sources vendored in PyPI's ``llama-cpp-python`` sdist (the Python
bindings the runtime uses are that package, installed without its own build by scripts/setup.sh):
shared libraries with ``GGML_NATIVE`` (the kernels this CPU has: AVX2, AVX-512, VNNI, BF16, AMX),
cached per llama.cpp version and CPU feature set in the git-ignored ``.cache/llama.cpp/<key>/``
(``python_backends.generation.llama_cpp_runtime.build_dir``), so a checkout moved to another CPU
builds again instead of running kernels its CPU lacks. The persistent build folder beside it makes
later targets (``llama-server``, the benchmark's peer) incremental.

The GGUF files are made from the FP32 export (``model.safetensors``), never from another GGUF:
llama.cpp's ``convert_hf_to_gguf.py`` (from the same sources) writes an F32 GGUF, and
``llama_model_quantize`` (the library's own quantizer, what ``llama-quantize`` runs) makes each
variant's file type from it.

    python -m export.llama_cpp build            # libraries (4-6 min on 2 cores, once per CPU)
    python -m export.llama_cpp build --server   # and llama-server (the benchmark peer)
    python -m export.llama_cpp gguf             # the variants' GGUF files in model_repository/text_generation/1/
    python -m export.llama_cpp where            # what is built and where
    python -m export.llama_cpp formats          # llama.cpp's file types against F16 on this model: KL, speed
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from python_backends.generation.llama_cpp_runtime import (
    BUILD_OPTIONS,
    LLAMA_CPP_VERSION,
    LLAMA_PRECISIONS,
    build_dir,
    build_key,
    cpu_features,
    gguf_file,
)

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "llama.cpp"
SDIST = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
# What the runtime and the export need from the sources besides the libraries.
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
LIBRARIES = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so")


class LlamaCppError(RuntimeError):
    pass


def source_dir() -> Path:
    return CACHE / f"src-{LLAMA_CPP_VERSION}"


def _build_folder() -> Path:
    return CACHE / f"build-{build_key()}"


def is_built(server: bool = False) -> bool:
    out = build_dir()
    return all((out / name).exists() for name in LIBRARIES) and (not server or (out / "llama-server").is_file())


def _pip_download(spec: str, dest: Path, source: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), spec]
    if source:
        cmd[4:4] = ["--no-binary", ":all:"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppError(f"pip download {spec} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(p for p in dest.iterdir() if p.name.replace("-", "_").startswith(name))
    if not found:
        raise LlamaCppError(f"pip download {spec}: nothing in {dest}")
    return found[-1]


def sources(say=print) -> Path:
    """The vendored llama.cpp sources, extracted once from the sdist."""
    target = source_dir()
    if (target / "CMakeLists.txt").is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="llama-src-") as tmp:
        say(f"llama.cpp: downloading the {SDIST} sdist")
        sdist = _pip_download(SDIST, Path(tmp) / "dl", source=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(Path(tmp) / "src", filter="data")
        (top,) = [p for p in (Path(tmp) / "src").iterdir() if p.is_dir()]
        vendored = top / "vendor" / "llama.cpp"
        if not (vendored / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{sdist.name}: no vendor/llama.cpp/CMakeLists.txt")
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        # Without its .git (a submodule link to a folder the sdist may not have): ggml's build-info
        # would otherwise watch a missing git index and ninja re-run cmake forever.
        shutil.copytree(vendored, staging, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
    return target


def build(server: bool = False, jobs: int | None = None, say=print) -> Path:
    """This CPU's llama.cpp libraries (and with ``server`` llama-server), built first if missing."""
    out = build_dir()
    if is_built(server):
        return out
    if os.environ.get("LLAMA_CPP_HOME"):
        raise LlamaCppError(f"LLAMA_CPP_HOME={out} lacks {', '.join(LIBRARIES)}{' or llama-server' if server else ''}")
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"{tool} not found: install the Debian packages cmake and ninja-build (scripts/setup.sh)")
    src = sources(say)
    folder = _build_folder()
    targets = ["llama"] + (["llama-server"] if server else [])
    say(
        f"llama.cpp: building {', '.join(targets)} (GGML_NATIVE for {', '.join(cpu_features()) or 'this CPU'}); "
        "4-10 minutes on 2 cores, once per CPU"
    )
    configure = [
        "cmake",
        "-S",
        str(src),
        "-B",
        str(folder),
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=ON",
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the libraries and tools find each other in one folder
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        *(f"-D{option}" for option in BUILD_OPTIONS),
    ]
    compile_ = ["cmake", "--build", str(folder), "--target", *targets] + (["-j", str(jobs)] if jobs else [])
    for cmd in (configure, compile_):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise LlamaCppError(f"{' '.join(cmd[:3])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    built = folder / "bin"
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(built.iterdir()):
        if path.name.startswith("lib") and ".so" in path.name or path.name in ("llama-server",):
            tmp = out / (path.name + ".tmp")
            if tmp.exists() or tmp.is_symlink():
                tmp.unlink()
            if path.is_symlink():
                tmp.symlink_to(os.readlink(path))
            else:
                shutil.copy2(path, tmp)
            tmp.replace(out / path.name)
    if not is_built(server):
        raise LlamaCppError(f"the build left {out} incomplete")
    say(f"llama.cpp: {out}")
    return out


def convert(model_dir: Path, out: Path) -> Path:
    """An F32 GGUF of the exported checkpoint in ``model_dir`` (llama.cpp's own converter, through
    ``export/gguf_convert.py``)."""
    src = sources()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)])}
    wrapper = Path(__file__).with_name("gguf_convert.py")  # a tokenizer llama.cpp does not know is not refused
    cmd = [
        sys.executable,
        str(wrapper),
        str(src / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.is_file():
        raise LlamaCppError(f"convert_hf_to_gguf.py failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return out


def quantize(source: Path, out: Path, file_type: str, allow_requantize: bool = False, head_type: str | None = None) -> Path:
    """``source`` quantized to ``file_type`` (Q4_0, Q8_0, F16, ...) by llama.cpp's quantizer; ``head_type``
    (a ggml type name: F16, BF16, Q8_0, ...) overrides the quantizer's choice for the output head and
    token embeddings."""
    from python_backends.generation.llama_cpp_runtime import load_library

    lib = load_library()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = allow_requantize
    if head_type is not None:
        ggml_type = getattr(lib, f"GGML_TYPE_{head_type}", None)
        if ggml_type is None:
            raise LlamaCppError(f"head type {head_type!r}: not a ggml type of llama.cpp {LLAMA_CPP_VERSION}")
        params.output_tensor_type = params.token_embedding_type = ggml_type
    tmp = out.with_name(out.name + ".tmp")
    status = lib.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if status != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"llama_model_quantize {source.name} -> {file_type} failed ({status})")
    tmp.replace(out)
    return out


def make_ggufs(model_dir: Path, precisions=tuple(LLAMA_PRECISIONS), say=log.info) -> dict[str, Path]:
    """Each variant's GGUF in ``model_dir``, made from its model.safetensors (F32 GGUF, then quantized)."""
    done: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=model_dir.parent) as tmp:
        f32 = None
        for precision in precisions:
            target = model_dir / gguf_file(precision)
            if f32 is None:
                say(f"text_generation: converting {model_dir.name}/model.safetensors to an F32 GGUF (llama.cpp's converter)")
                f32 = convert(model_dir, Path(tmp) / "model-f32.gguf")
            say(f"text_generation: quantizing to {LLAMA_PRECISIONS[precision]} -> {target.name}")
            quantize(f32, target, LLAMA_PRECISIONS[precision])
            target.chmod(0o644)
            done[precision] = target
    return done


# (body, head) file types the ``formats`` command compares; "default" is the quantizer's own head choice
# (Q8_0 here: 576-wide rows are no multiple of K-quants' 256).
FORMATS = (
    ("Q4_0", "default"),
    ("Q4_1", "default"),
    ("Q8_0", "default"),
    ("Q4_0", "F16"),
    ("IQ4_NL", "F16"),
    ("Q5_0", "F16"),
    ("Q5_1", "F16"),
    ("Q4_1", "F16"),
    ("Q8_0", "F16"),
    ("BF16", "BF16"),
)


def _logits_and_decode(lib, path: Path, token_ids: list[list[int]], threads: int) -> tuple[list, float]:
    """Teacher-forced logits of each text (one batch each), and decode ms per token (one sequence, 64 steps)."""
    import numpy as np

    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    if not model:
        raise LlamaCppError(f"llama.cpp could not load {path}")
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    longest = max(len(ids) for ids in token_ids)
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = longest + 64
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, cparams)
    if not ctx:
        lib.llama_model_free(model)
        raise LlamaCppError(f"llama.cpp could not make a context for {path}")
    batch = lib.llama_batch_init(longest + 64, 0, 1)
    mem = lib.llama_get_memory(ctx)
    out = []
    try:
        for ids in token_ids:
            lib.llama_memory_clear(mem, True)
            for i, t in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(ids)
            if lib.llama_decode(ctx, batch) != 0:
                raise LlamaCppError(f"llama_decode failed on {path.name}")
            flat = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(ids) * vocab,))
            out.append(flat.reshape(len(ids), vocab).astype(np.float64))
        n = len(token_ids[-1])
        batch.n_tokens = 1
        start = time.perf_counter()
        for j in range(64):
            batch.token[0], batch.pos[0] = token_ids[-1][j % n], n + j
            if lib.llama_decode(ctx, batch) != 0:
                raise LlamaCppError(f"llama_decode failed on {path.name}")
            lib.llama_get_logits_ith(ctx, 0)
        decode_ms = (time.perf_counter() - start) / 64 * 1e3
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return out, decode_ms


def _kl_top1(reference: list, logits: list) -> tuple[float, float]:
    import numpy as np

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    kls, agree = [], []
    for ref, got in zip(reference, logits, strict=True):
        p, q = log_softmax(ref), log_softmax(got)
        kls.append((np.exp(p) * (p - q)).sum(-1))
        agree.append(ref.argmax(-1) == got.argmax(-1))
    return float(np.concatenate(kls).mean()), float(np.concatenate(agree).mean())


def compare_formats(model_dir: Path, threads: int | None = None, say=print) -> list[dict]:
    """Each of FORMATS made from the FP32 export, against its F16 file on the gate's held-out texts:
    mean KL and top-1 agreement as llama.cpp computes (8-bit activations for quantized weights), the
    same for the weights alone (the file requantized to F16: F16 products), size and decode speed."""
    from tokenizers import Tokenizer

    from export.generation_gate import heldout_texts
    from python_backends.generation.llama_cpp_runtime import load_library

    lib = load_library()
    threads = int(threads or os.cpu_count() or 1)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    token_ids = [tokenizer.encode(t["text"]).ids[:512] for t in heldout_texts()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-formats-", dir=model_dir.parent) as tmp:
        f32 = convert(model_dir, Path(tmp) / "model-f32.gguf")
        f16 = quantize(f32, Path(tmp) / "f16.gguf", "F16")
        reference, f16_ms = _logits_and_decode(lib, f16, token_ids, threads)
        rows.append(
            {
                "body": "F16",
                "head": "F16",
                "mib": f16.stat().st_size / 2**20,
                "kl": 0.0,
                "top1": 1.0,
                "weights_kl": 0.0,
                "ms": f16_ms,
            }
        )
        for body, head in FORMATS:
            path = quantize(f32, Path(tmp) / f"{body}-{head}.gguf", body, head_type=None if head == "default" else head)
            logits, ms = _logits_and_decode(lib, path, token_ids, threads)
            kl, top1 = _kl_top1(reference, logits)
            dequantized = quantize(path, Path(tmp) / "dequantized.gguf", "F16", allow_requantize=True)
            weights_kl, _ = _kl_top1(reference, _logits_and_decode(lib, dequantized, token_ids, threads)[0])
            rows.append(
                {
                    "body": body,
                    "head": head,
                    "mib": path.stat().st_size / 2**20,
                    "kl": kl,
                    "top1": top1,
                    "weights_kl": weights_kl,
                    "ms": ms,
                }
            )
            say(f"{body} head {head}: mean KL {kl:.5f}, top-1 {top1:.4f}, weights alone {weights_kl:.5f}, {ms:.2f} ms/token")
            path.unlink()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m export.llama_cpp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=("build", "gguf", "where", "formats"))
    p.add_argument("--server", action="store_true", help="build llama-server too (the benchmark's peer)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: ninja's)")
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "text_generation" / "1")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        if args.command == "build":
            print(build(args.server, args.jobs))
        elif args.command == "formats":
            print("| body | head | MiB | mean KL vs F16 | top-1 vs F16 | weights alone: mean KL | decode ms/token |")
            print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
            for r in compare_formats(args.model_dir, say=lambda line: print(line, file=sys.stderr)):
                print(
                    f"| {r['body']} | {r['head']} | {r['mib']:.0f} | {r['kl']:.5f} | {r['top1']:.4f} | {r['weights_kl']:.5f} | {r['ms']:.2f} |"
                )
        elif args.command == "gguf":
            for precision, path in make_ggufs(args.model_dir, say=print).items():
                print(f"{precision}: {path}")
        else:
            print(f"key: {build_key()} ({', '.join(cpu_features())})")
            print(f"libraries: {build_dir()} ({'present' if is_built() else 'missing'})")
            print(f"llama-server: {build_dir() / 'llama-server'} ({'present' if is_built(True) else 'missing'})")
    except LlamaCppError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

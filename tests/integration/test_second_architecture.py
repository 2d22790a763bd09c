"""A second architecture through export, gate, serving and the gateway: a tiny random-init Qwen2
checkpoint (tests/unit/test_generation_qwen2.py) exported by ``export.generation --weights`` into a
copy of the model repository, its precision variants gated on this CPU, served as
``text_generation`` by a real tritonserver, and asked through the OpenAI gateway with the openai
SDK, streamed and whole: the greedy text is transformers' own on the checkpoint.

The checkpoint borrows SmolLM2's vocabulary, which transformers tokenizes with Qwen2's own
pre-tokenizer for a Qwen2 model: a tokenizer llama.cpp's converter does not know, converted all the
same (export/gguf_convert.py), so every runtime's variants are built and judged."""

from __future__ import annotations

import os
import shutil

import pytest

from export import generation
from server.layout import ROOT
from tests.integration.conftest import GATEWAY_TEST_KEY
from tests.unit.test_generation_qwen2 import MODEL_DIR, build_tiny_qwen2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "tokenizer.json").is_file(), reason="text_generation not exported (python -m export.generation)"
)

MODEL = "text_generation"
NEW_TOKENS = 12
QUESTIONS = ("What is the capital of France?", "Écris une phrase sur la mer.")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(repository, checkpoint): the repository's other models linked, text_generation's config and
    shim copied, the Qwen2 checkpoint exported into it and gated against transformers."""
    base = tmp_path_factory.mktemp("qwen2")
    checkpoint = build_tiny_qwen2(base / "checkpoint")
    source, repo = (ROOT / "model_repository").resolve(), base / "model_repository"
    repo.mkdir()
    for entry in source.iterdir():
        if entry.name != MODEL:
            os.symlink(entry, repo / entry.name)
    (repo / MODEL / "1").mkdir(parents=True)
    shutil.copy(source / MODEL / "config.pbtxt", repo / MODEL / "config.pbtxt")
    shutil.copy(source / MODEL / "1" / "model.py", repo / MODEL / "1" / "model.py")
    result = generation.export(repo, weights=checkpoint)
    assert result.metrics["passed"], result.metrics
    assert '"Qwen2ForCausalLM"' in (generation.version_dir(repo) / "config.json").read_text()
    gated = generation.gate_precisions(repo, probe=False)  # auto's choice by order: speed is not the point here
    return repo, checkpoint, gated


def test_every_variant_of_the_qwen2_is_built_and_judged(exported):
    """The GGUF-based ones too: llama.cpp's converter and runtime, and OpenVINO GenAI's GGUF reader,
    take Qwen2's biases (their F16 variants agree with the FP32 engine on every position here)."""
    from export.llama_cpp import is_built
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS

    rows = exported[2]["variants"]
    assert rows["fp32"]["status"] == "passed"
    for precision, row in rows.items():
        assert not any(f.startswith("build:") for f in row["failures"]), (precision, row)
        assert row["metrics"]["positions"] > 0, (precision, row)
    for precision in ("llama_f16", "ov_f16"):
        if precision in rows:  # where llama.cpp is built
            assert rows[precision]["metrics"]["top1_agreement"] >= 0.99, rows[precision]
    if is_built():
        assert set(LLAMA_PRECISIONS) <= set(rows), sorted(rows)
    assert exported[2]["best"]["cpu"] in rows


@pytest.fixture(scope="module")
def expected(exported):
    """transformers' greedy text of each question on the checkpoint, chat template applied."""
    checkpoint = exported[1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    texts = []
    for question in QUESTIONS:
        ids = generation.chat_ids(tokenizer, question)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        texts.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    assert any(texts), texts  # a random model still says something
    return texts


@pytest.fixture(scope="module")
def client(start_triton, start_gateway, exported):
    import openai

    repo = exported[0]
    with start_triton("triton-qwen2-", (MODEL,), model_repository=repo) as server:
        with start_gateway(server.triton_grpc_url, "--rate-limit", "0", "--model-repository", str(repo)) as gw:
            sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=GATEWAY_TEST_KEY, max_retries=0, timeout=120)
            yield sdk
            sdk.close()


def test_qwen2_is_served_through_the_gateway_as_transformers_generates(client, expected):
    for question, want in zip(QUESTIONS, expected):
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        assert whole.choices[0].message.content == want
        assert whole.usage.completion_tokens <= NEW_TOKENS
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == want and len([p for p in pieces if p]) > 1

"""What evaluation harnesses send to /v1/completions, through the real gateway and tritonserver.

``echo`` with ``logprobs`` returns the prompt's token log-probabilities (the first null, as OpenAI
did), ``max_tokens`` 0 with echo the prompt alone; prompts come as a list of strings, a token
array or a list of token arrays (one choice per prompt and n, usage added up). The served
log-probabilities are checked per token against transformers on the same FP32 weights, and
lm-evaluation-harness's ``local-completions`` model scores a small multiple-choice task (tests/data/
lm_eval) against the gateway exactly as its ``hf`` model does in process.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from server.layout import ROOT
from tests.integration.conftest import GATEWAY_TEST_KEY

GENERATION = "text_generation"
MODEL_DIR = ROOT / "model_repository" / GENERATION / "1"
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Écris une phrase sur la mer, s'il te plaît.",
]
# The FP32 PyTorch runtime computes transformers' numbers (tests/unit/test_generation_prompt_logprobs.py:
# under 1e-3 per token); the gates of the other variants allow more (docs/export-report.md).
TOLERANCE = {"fp32": 1e-3}


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def served_precision(grpc_client) -> str:
    params = grpc_client.get_model_config(GENERATION, as_json=True)["config"]["parameters"]
    return params["weights_precision"]["string_value"]


def test_echo_logprobs_of_a_list_of_prompts_match_transformers(openai_client, hf, served_precision):
    tok, model = hf
    answer = openai_client.completions.create(
        model=GENERATION, prompt=PROMPTS, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    diffs = []
    for prompt, choice in zip(PROMPTS, answer.choices):
        ids = tok(prompt, add_special_tokens=False).input_ids
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        lp = choice.logprobs
        assert choice.text == prompt == "".join(lp.tokens) and choice.finish_reason == "length"
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        for pos in range(1, len(ids)):
            diffs.append(abs(lp.token_logprobs[pos] - float(logp[pos - 1, ids[pos]])))
            (top,) = lp.top_logprobs[pos].values()
            assert abs(top - float(logp[pos - 1].max())) < TOLERANCE[served_precision]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(
        f"prompt logprobs, {served_precision} served vs transformers FP32: max {worst:.2e}, mean {mean:.2e} over {len(diffs)} tokens"
    )
    assert worst < TOLERANCE[served_precision], (worst, mean)
    usage = answer.usage
    assert usage.completion_tokens == 0 and usage.prompt_tokens == sum(
        len(tok(p, add_special_tokens=False).input_ids) for p in PROMPTS
    )


def test_token_prompts_echo_and_choices(openai_client, gateway, hf):
    tok, _ = hf
    arrays = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    answer = openai_client.completions.create(
        model=GENERATION, prompt=arrays, max_tokens=2, n=2, echo=True, logprobs=0, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for k, choice in enumerate(answer.choices):
        prompt = PROMPTS[k // 2]
        assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(arrays[k // 2]) + 2
        assert choice.logprobs.token_logprobs[0] is None and all(v is not None for v in choice.logprobs.token_logprobs[1:])
    assert answer.usage.prompt_tokens == sum(map(len, arrays)) and answer.usage.completion_tokens == 8
    one = openai_client.completions.create(model=GENERATION, prompt=arrays[0], max_tokens=3, temperature=0)
    by_text = openai_client.completions.create(model=GENERATION, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert one.choices[0].text == by_text.choices[0].text and one.usage == by_text.usage
    # Streamed: the echo's chunk carries the prompt's tokens, the answer's chunks their own.
    chunks = list(
        openai_client.completions.create(
            model=GENERATION, prompt=PROMPTS[0], max_tokens=2, echo=True, logprobs=0, temperature=0, stream=True
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": [[1, 2], [49152]]}, "prompt", "token id 49152"),
        ({"prompt": "Once", "max_tokens": 0}, "max_tokens", "only with echo"),
        ({"prompt": ["a", "b"], "stream": True}, "stream", "one prompt"),
        ({"prompt": [[]]}, "prompt", "empty token array"),
    ],
)
def test_refusals_name_the_field(openai_client, body, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=GENERATION, **body)
    error = caught.value.response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_lm_eval_local_completions_scores_as_in_process(gateway, monkeypatch, tmp_path, served_precision):
    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", GATEWAY_TEST_KEY)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(ROOT / "tests" / "data" / "lm_eval"), include_defaults=False)

    def run(model: str, args: dict) -> tuple[float, list[list[float]]]:
        out = simple_evaluate(model=model, model_args=args, tasks=["capitals_mc"], task_manager=tasks, log_samples=True)
        assert out is not None
        samples = sorted(out["samples"]["capitals_mc"], key=lambda s: s["doc_id"])
        return out["results"]["capitals_mc"]["acc,none"], [[float(r[0]) for r in s["filtered_resps"]] for s in samples]

    served_acc, served = run(
        "local-completions",
        {
            "model": GENERATION,
            "base_url": f"{gateway.url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(MODEL_DIR),
            "batch_size": 8,  # lists of token arrays, as the harness batches them
            "max_retries": 1,
        },
    )
    local_acc, local = run("hf", {"pretrained": str(MODEL_DIR), "dtype": "float32", "device": "cpu", "batch_size": 8})
    diffs = [abs(a - b) for s, h in zip(served, local) for a, b in zip(s, h)]
    print(
        json.dumps(
            {
                "acc_served": served_acc,
                "acc_in_process": local_acc,
                "loglikelihood_max_abs_diff": max(diffs),
                "precision": served_precision,
            }
        )
    )
    assert len(served) == len(local) == 8 and served_acc == local_acc
    # A choice's loglikelihood sums its tokens' (one to four here): the per-token tolerance, four times.
    assert max(diffs) < 4 * TOLERANCE[served_precision], diffs

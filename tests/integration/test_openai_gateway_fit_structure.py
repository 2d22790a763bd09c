"""fit_structure_to_max_tokens through the gateway and tritonserver, with the openai SDK: a Pydantic
model with an unbounded list[str] that a 135M model fills until max_tokens cuts it parses with the
option (finish_reason stop, the choice's structure_fitted true, in the last stream chunk too), and
raises the SDK's LengthFinishReasonError without it, as before."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic
import pytest

GENERATION = "text_generation"
PROMPT = "List every country of Asia with its cities, as JSON."
MAX_TOKENS = 48
SEEDS = (1, 2)
FIT = {"fit_structure_to_max_tokens": True}


class Countries(pydantic.BaseModel):
    region: str
    countries: list[str]


def _parse(client, seed: int, extra_body: dict | None = None):
    return client.chat.completions.parse(
        model=GENERATION,
        messages=[{"role": "user", "content": PROMPT}],
        response_format=Countries,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=seed,
        extra_body=extra_body,
    )


def test_an_answer_that_would_be_cut_parses_when_fitted(openai_client):
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        answers = list(pool.map(lambda seed: _parse(openai_client, seed, FIT), SEEDS))
    fitted = []
    for seed, answer in zip(SEEDS, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Countries), choice.message.content
        assert answer.usage.completion_tokens <= MAX_TOKENS
        if (choice.model_extra or {}).get("structure_fitted"):
            fitted.append(seed)
    assert fitted, "no answer needed fitting: the prompt no longer makes the model loop"
    with pytest.raises(openai.LengthFinishReasonError):  # the same sampled tokens without the option: cut
        _parse(openai_client, fitted[0])


def test_the_last_stream_chunk_says_the_answer_was_fitted(openai_client):
    stream = openai_client.chat.completions.create(
        model=GENERATION,
        messages=[{"role": "user", "content": PROMPT}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "countries", "schema": Countries.model_json_schema()},
        },
        max_tokens=24,
        temperature=0.7,
        seed=SEEDS[0],
        stream=True,
        extra_body=FIT,
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and (last.model_extra or {}).get("structure_fitted") is True, text
    Countries.model_validate_json(text)

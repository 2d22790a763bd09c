"""fit_structure_to_max_tokens (python_backends/generation/structured.py: closing, Fitting) with the
model's real tokenizer and llguidance, then on the engine: a guided answer that would loop until
max_tokens cuts it closes instead, parses, validates against its schema and ends with finish reason
stop and the fitted flag; without the option it is cut as before."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from contract.errors import InputError
from contract.sampling import SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
WORDS = {"type": "array", "items": {"type": "string"}}
SCHEMAS = {
    "list_of_strings": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "countries": WORDS, "population": {"type": "number"}},
        "required": ["name", "countries", "population"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "districts": {"type": "array", "items": WORDS}},
                "required": ["name", "districts"],
            },
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
        "required": ["city", "tags"],
    },
    "numbers": {
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "number"}}, "total": {"type": "integer"}},
        "required": ["values", "total"],
    },
    "strings": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 3},
            "kind": {"enum": ["alpha", "beta"]},
            "note": {"type": "string"},
        },
        "required": ["title", "kind"],
    },
}
# What a looping small model writes inside each schema: the answer's start, then a piece it repeats.
LOOPS = {
    "list_of_strings": ('{"name": "Asia", "countries": ["China", "', "Ichi-"),
    "nested": ('{"city": {"name": "Kyoto", "districts": [["', "Higashi-"),
    "numbers": ('{"values": [1', "2"),
    "strings": ('{"title": "', "China, "),
}


@pytest.fixture(scope="module")
def tokenizer():
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("text_generation not exported (python -m export.generation)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from python_backends.generation.structured import Grammars

    return Grammars(tokenizer, 49152)


def run_loop(grammars, tokenizer, schema: dict, start: str, piece: str, max_tokens: int, fit: bool) -> tuple[str, bool]:
    """A model that writes ``start`` then ``piece`` again and again while the guide takes it (else
    the closing's token, as a guide's mask would leave it), until EOS or ``max_tokens``; the text and
    whether the answer was fitted."""
    from python_backends.generation.structured import closing

    source = json.dumps(schema)
    matcher = grammars.matcher("guided_json", source)
    fitting = grammars.fitting("guided_json") if fit else None
    eos = grammars.tokenizer.eos_token
    proposals = tokenizer.encode(start, add_special_tokens=False)
    loop = tokenizer.encode(piece, add_special_tokens=False)
    out: list[int] = []
    while len(out) < max_tokens and not matcher.is_stopped():
        token = proposals.pop(0) if proposals else loop[len(out) % len(loop)]
        if matcher.validate_tokens([token]) != 1:  # the mask refuses it: the guide's way on
            path = closing(matcher, 64, fitting.tables if fitting else grammars.fitting("guided_json").tables, None)
            token = eos if not path else path[0]
        kept = fitting.take(matcher, token, len(out), max_tokens) if fitting else token
        if fitting is None:
            assert matcher.consume_token(kept)
        if kept == eos:
            break
        out.append(kept)
    return tokenizer.decode(out), bool(fitting and fitting.fitted)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("max_tokens", [24, 40])
def test_a_looping_answer_closes_within_max_tokens_and_validates(grammars, tokenizer, name, max_tokens):
    start, piece = LOOPS[name]
    text, fitted = run_loop(grammars, tokenizer, SCHEMAS[name], start, piece, max_tokens, fit=True)
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert fitted and len(tokenizer.encode(text, add_special_tokens=False)) <= max_tokens
    cut, _ = run_loop(grammars, tokenizer, SCHEMAS[name], start, piece, max_tokens, fit=False)
    with pytest.raises(json.JSONDecodeError):  # without the option: cut at max_tokens, as before
        json.loads(cut)


@pytest.mark.parametrize(
    "field, source, prefix, closed",
    [
        (
            "guided_json",
            json.dumps(SCHEMAS["list_of_strings"]),
            '{"name": "a", "countries": ["Chi',
            '{"name": "a", "countries": ["Chi"], "population": 0}',
        ),
        ("guided_json", json.dumps({"type": "object"}), '{"x": [1, {"y": "zz', '{"x": [1, {"y": "zz"}]}'),
        ("guided_regex", r"\d{3}-\d{4}", "55", "550-0000"),
        ("guided_choice", json.dumps(["red", "blue", "green"]), "gr", "green"),
        ("guided_grammar", 'start: "(" expr ")"\nexpr: NUMBER | expr "+" expr\n%import common.NUMBER', "(1+2", "(1+2)"),
    ],
    ids=["json_schema", "json_object", "regex", "choice", "grammar"],
)
def test_the_closing_completes_every_kind_of_guide(grammars, tokenizer, field, source, prefix, closed):
    from python_backends.generation.structured import closing, quoted_after

    matcher = grammars.matcher(field, source)
    tables = grammars.fitting(field).tables
    quoted = (False, False) if field == "guided_json" else None
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.consume_token(token)
        quoted = quoted and quoted_after(quoted, tables.token_bytes[token])
    path = closing(matcher, 32, tables, quoted)
    assert path is not None and prefix + tokenizer.decode(path) == closed
    assert closing(matcher, len(path) - 1, tables, quoted) is None if path else True  # no shorter one within the limit
    assert closing(matcher, 32, tables, quoted) == path  # the matcher itself did not move


def test_when_even_the_closing_does_not_fit_it_runs_as_without_the_option(grammars, tokenizer):
    schema = SCHEMAS["nested"]
    text, fitted = run_loop(grammars, tokenizer, schema, *LOOPS["nested"], max_tokens=8, fit=True)
    assert not fitted
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_the_option_is_a_boolean_sampling_field():
    assert SamplingParams(fit_structure_to_max_tokens=True).fit_structure_to_max_tokens
    with pytest.raises(InputError, match="fit_structure_to_max_tokens: must be true or false"):
        SamplingParams(fit_structure_to_max_tokens="yes")


QUESTIONS = ["List every country in Asia as JSON.", "Describe China in JSON with many tags."]


def test_the_engine_closes_a_sampled_answer_that_would_be_cut(tokenizer):
    import torch

    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig

    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("text_generation weights not exported (python -m export.generation)")
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model_dir=MODEL_DIR, num_blocks=64, max_num_seqs=4, max_model_len=512), tokenizer=tokenizer)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    schema = SCHEMAS["list_of_strings"]
    for fit in (True, False):
        params = SamplingParams(max_tokens=32, temperature=0.7, seed=3, guided_json=schema, fit_structure_to_max_tokens=fit)
        for i, prompt in enumerate(prompts):
            engine.add_request((fit, i), prompt, params)
        texts: dict = {}
        finals: dict = {}
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] = texts.get(out.request_id, "") + out.text
                if out.finished:
                    finals[out.request_id] = out
        for i in range(len(prompts)):
            final = finals[(fit, i)]
            assert final.num_output_tokens <= 32
            if fit:
                jsonschema.validate(json.loads(texts[(fit, i)]), schema)
                assert final.finish_reason == "stop"
            else:  # as before: these answers loop until max_tokens cuts them
                assert (final.finish_reason, final.structure_fitted) == ("length", False)
        if fit:
            assert any(finals[(fit, i)].structure_fitted for i in range(len(prompts)))


def test_the_final_response_carries_structure_fitted_only_when_true():
    from python_backends.generation.serving import GenerationRequest, ResponseShaper

    request = GenerationRequest(prompt="P:", params=SamplingParams(), stream=True, return_finish_reason=True)
    shaper = ResponseShaper(request)
    assert shaper.on_output("{", False, None, 3, 1, structure_fitted=False) == {"text_output": "{", "finish_reason": None}
    final = {"text_output": "}", "finish_reason": "stop", "structure_fitted": True}
    assert shaper.on_output("}", True, "stop", 3, 2, structure_fitted=True) == final
    assert "structure_fitted" not in ResponseShaper(request).on_output("}", True, "stop", 3, 2)


def test_a_closing_completes_a_character_split_over_tokens_first(grammars, tokenizer):
    from python_backends.generation.structured import closing, quoted_after

    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    ids = tokenizer.encode('{"title": "細', add_special_tokens=False)[:-1]  # the character's first two bytes
    matcher, tables, quoted = (
        grammars.matcher("guided_json", json.dumps(schema)),
        grammars.fitting("guided_json").tables,
        (False, False),
    )
    for token in ids:
        assert matcher.consume_token(token)
        quoted = quoted_after(quoted, tables.token_bytes[token])
    path = closing(matcher, 8, tables, quoted)
    assert path is not None
    jsonschema.validate(json.loads(tokenizer.decode(ids + path)), schema)


def test_the_servers_default_applies_to_requests_that_do_not_say():
    from python_backends.generation.sampling import parse_sampling_params

    default = {"fit_structure_to_max_tokens": True}  # config.pbtxt's parameter set to true (entry.py)
    limits = {"max_tokens_limit": 64, "default_max_tokens": 16, "defaults": default}
    assert parse_sampling_params("{}", **limits).fit_structure_to_max_tokens
    assert not parse_sampling_params('{"fit_structure_to_max_tokens": false}', **limits).fit_structure_to_max_tokens

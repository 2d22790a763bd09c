"""Sampling parameters' validation and the batched sampler."""

from __future__ import annotations

import pytest
import torch

from contract.errors import InputError
from python_backends.generation.sampling import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_top_k_top_p,
    make_generator,
    parse_sampling_params,
)

VOCAB = 500
EOS = 7


def parse(source, limit=256, **kw):
    return parse_sampling_params(source, max_tokens_limit=limit, **kw)


# ---- parameters -----------------------------------------------------------------------


def test_parse_full_json_and_defaults():
    p = parse(
        b'{"max_tokens": 32, "min_tokens": 2, "temperature": 0, "top_p": 0.9, "top_k": 40,'
        b' "seed": 5, "stop": ["\\n\\n", "User:"], "ignore_eos": true, "repetition_penalty": 1.1}'
    )
    assert p == SamplingParams(32, 2, 0.0, 0.9, 40, 5, ("\n\n", "User:"), True, 1.1)
    assert p.greedy
    assert parse(None) == parse(b"") == parse({}) == SamplingParams()
    assert parse('{"stop": "###"}').stop == ("###",)
    assert parse({"temperature": 1}).temperature == 1.0  # an int is a fine number
    assert parse({"stop_token_ids": [9, 2, 9]}).stop_token_ids == (2, 9)  # sorted, once each
    assert parse({}, default_max_tokens=64).max_tokens == 64


@pytest.mark.parametrize(
    "source, field, words",
    [
        ('{"max_tokens": 3', "sampling_parameters", "not valid JSON"),
        (b"\xff\xfe", "sampling_parameters", "not UTF-8"),
        ("[1, 2]", "sampling_parameters", "must be a JSON object"),
        ({"best_of": 2}, "best_of", "unknown sampling parameter"),
        ({"n": 0}, "n", "must be between 1 and 16"),
        ({"n": 17}, "n", "must be between 1 and 16"),
        ({"max_tokens": 0}, "max_tokens", "must be > 0"),
        ({"max_tokens": -4}, "max_tokens", "must be > 0"),
        ({"max_tokens": 257}, "max_tokens", "must be <= 256, got 257"),
        ({"max_tokens": "12"}, "max_tokens", "must be an integer"),
        ({"max_tokens": 12.0}, "max_tokens", "must be an integer"),
        ({"max_tokens": True}, "max_tokens", "must be an integer"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "between 0 and max_tokens (10)"),
        ({"temperature": -0.1}, "temperature", "must be >= 0"),
        ({"temperature": "hot"}, "temperature", "must be a number"),
        ({"temperature": float("nan")}, "temperature", "must be finite"),
        ({"top_p": 0}, "top_p", "must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p", "must be in (0, 1]"),
        ({"top_k": -1}, "top_k", "must be between 0 (0 disables it) and"),
        ({"top_k": 2**63}, "top_k", "must be between 0 (0 disables it) and"),
        ({"repetition_penalty": 0}, "repetition_penalty", "must be in (0, 10]"),
        ({"repetition_penalty": 11}, "repetition_penalty", "must be in (0, 10], got 11"),
        ({"fit_to_context": 1}, "fit_to_context", "true or false"),
        ({"seed": -1}, "seed", "between 0 and"),
        ({"seed": 1.5}, "seed", "must be an integer"),
        ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
        ({"stop": ["a"] * 17}, "stop", "at most 16 stop strings, got 17"),
        ({"stop": ["x" * 257]}, "stop", "<= 256 characters, got 257"),
        ({"stop": [""]}, "stop", "must not be empty"),
        ({"stop": [1]}, "stop", "string or a list of strings"),
        ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2, got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "between -2 and 2"),
        ({"frequency_penalty": "1"}, "frequency_penalty", "must be a number"),
        ({"min_p": 1.5}, "min_p", "between 0 and 1"),
        ({"min_p": -0.1}, "min_p", "between 0 and 1"),
        ({"logit_bias": [1, 2]}, "logit_bias", "object of token id -> bias"),
        ({"logit_bias": "x"}, "logit_bias", "object of token id -> bias"),
        ({"logit_bias": {"hello": 1}}, "logit_bias['hello']", "keys must be token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias['-1']", "keys must be token ids"),
        ({"logit_bias": {"9" * 40: 1}}, "logit_bias['" + "9" * 24 + "']", "keys must be token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias['5']", "between -100 and 100, got 101"),
        ({"logit_bias": {"5": float("inf")}}, "logit_bias['5']", "must be finite"),
        ({"logit_bias": {"5": "up"}}, "logit_bias['5']", "must be a number"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024 tokens, got 1025"),
        ({"stop_token_ids": 5}, "stop_token_ids", "must be a list of token ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0]", "must be an integer"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]", "must be a token id >= 0"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256 token ids, got 257"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "true or false"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens", "true or false"),
    ],
)
def test_parse_errors_name_the_field_and_limit(source, field, words):
    with pytest.raises(SamplingParamsError) as info:
        parse(source)
    assert info.value.field == field
    assert words in str(info.value)
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, InputError)  # the shims map it to INVALID_ARG


def test_values_come_with_the_error_as_data():
    with pytest.raises(SamplingParamsError) as info:
        parse({"max_tokens": 300})
    assert (info.value.code, info.value.field, info.value.values) == ("invalid_value", "max_tokens", {"maximum": 256, "got": 300})
    with pytest.raises(SamplingParamsError) as info:
        parse({"stop": ["a"] * 17})
    assert info.value.values == {"maximum": 16, "got": 17}


def test_sampling_params_validate_themselves_however_they_are_made():
    with pytest.raises(InputError, match="top_p: must be in"):
        SamplingParams(top_p=0)
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(temperature=1).temperature == 1.0


def test_null_max_tokens_asks_for_the_rest_of_the_context():
    p = parse({"max_tokens": None})
    assert (p.max_tokens, p.fit_to_context) == (256, True)
    assert parse({"seed": None, "stop": None}) == SamplingParams()


# ---- sampler --------------------------------------------------------------------------


def rand_logits(batch, seed=0):
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = rand_logits(6)
    sampler = Sampler()
    greedy = sampler(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(greedy, logits.argmax(-1))
    top1 = sampler(logits, [SamplingParams(temperature=1.3, top_k=1)] * 6)
    assert torch.equal(top1, greedy)


def test_seeded_row_same_alone_and_in_any_batch():
    steps, sampler = 20, Sampler()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=99, top_k=5)]

    def run(position, companions):
        gens = [make_generator(p.seed) for p in companions]
        gens.insert(position, make_generator(seeded.seed))
        params = list(companions)
        params.insert(position, seeded)
        tokens = []
        for step in range(steps):
            logits = rand_logits(len(params), seed=100 + step)
            # The seeded row sees the same logits in every layout.
            logits[position] = rand_logits(1, seed=step)[0]
            tokens.append(sampler(logits, params, generators=gens)[position].item())
        return tokens

    alone = run(0, [])
    assert len(set(alone)) > 3  # really sampling, not stuck on one token
    assert run(0, others) == alone
    assert run(2, others) == alone
    assert run(3, others[::-1]) == alone
    # A different seed gives different tokens: the assert above can fail.
    gens = [make_generator(4321)]
    other = [sampler(rand_logits(1, seed=s), [seeded], generators=gens).item() for s in range(steps)]
    assert other != alone


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()

    def kept(top_p, top_k=0):
        out = apply_top_k_top_p(logits.clone(), torch.tensor([top_k]), torch.tensor([top_p]))
        return set(torch.isfinite(out[0]).nonzero().flatten().tolist())

    assert kept(0.4) == {1}
    assert kept(0.75) == {1, 3}
    assert kept(0.85) == {1, 3, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    assert kept(1.0, top_k=2) == {1, 3}
    assert kept(0.6, top_k=3) == {1, 3}
    # Sampled tokens never leave the nucleus.
    sampler, p = Sampler(), SamplingParams(temperature=1.0, top_p=0.75, seed=3)
    gen = make_generator(3)
    seen = {sampler(logits, [p], generators=[gen]).item() for _ in range(300)}
    assert seen == {1, 3}


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = rand_logits(4, seed=5)
    history = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 10, 40, 40)]
    history[3][:20] = history[3][0]  # repeated ids are penalised once
    sampler = Sampler()
    for penalty in (1.3, 0.7):
        for b, ids in enumerate(history):
            ref = RepetitionPenaltyLogitsProcessor(penalty)(ids[None, :], logits[b : b + 1].clone())
            params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)]
            mine = apply_repetition_penalty(logits[b].clone(), ids.tolist(), penalty)
            assert torch.allclose(mine, ref[0], atol=0, rtol=0)
            # Greedy with the penalty picks the argmax of the penalised row.
            assert sampler(logits[b : b + 1], params, token_ids=[ids.tolist()]).item() == ref[0].argmax().item()


def test_new_fields_parse_and_normalise():
    p = parse({"presence_penalty": 1, "frequency_penalty": -0.5, "min_p": 0.1, "logit_bias": {"12": 5, "3": -100, "7": 0.5}})
    assert (p.presence_penalty, p.frequency_penalty, p.min_p) == (1.0, -0.5, 0.1)
    assert p.logit_bias == ((3, -100.0), (7, 0.5), (12, 5.0))  # sorted by id, floats
    assert parse({"logit_bias": {}}).logit_bias is None and parse({}).logit_bias is None
    assert p.penalises_history and not SamplingParams().penalises_history
    assert hash(p) and SamplingParams(logit_bias=p.logit_bias) == p.__class__(logit_bias={"12": 5, "7": 0.5, "3": -100})


def test_presence_and_frequency_penalties_are_openais_over_the_output_only():
    logits = rand_logits(1, seed=3)[0]
    output = [4, 9, 4, 4, 11]
    mine = apply_presence_frequency(logits.clone(), output, 0.5, 0.25)
    ref = logits.clone()
    for token in set(output):  # OpenAI's formula: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
        ref[token] -= output.count(token) * 0.25 + 0.5
    assert torch.equal(mine, ref)
    # Through the sampler: the prompt's tokens are not penalised, the generated ones are.
    row = torch.zeros(1, VOCAB)
    row[0, 20], row[0, 21], row[0, 22] = 3.0, 2.9, 2.8
    prompt, generated = [21, 21, 21], [20]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5)]
    sampler = Sampler()
    assert sampler(row, params, token_ids=[prompt + generated], num_generated=[1]).item() == 21
    freq = [SamplingParams(temperature=0.0, frequency_penalty=0.06)]
    assert sampler(row, freq, token_ids=[prompt + [20, 21]], num_generated=[2]).item() == 20  # 2.94 vs 2.84
    freq = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    assert sampler(row, freq, token_ids=[prompt + [20, 20, 21]], num_generated=[3]).item() == 22  # 2.6, 2.7 vs 2.8
    assert sampler(row, [SamplingParams(temperature=0.0, presence_penalty=-2)], token_ids=[[22]], num_generated=[1]).item() == 22


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = rand_logits(2, seed=9)
    top = logits.argmax(dim=-1)
    sampler = Sampler()
    forced = SamplingParams(temperature=0.0, logit_bias={"17": 100})
    banned = SamplingParams(temperature=0.0, logit_bias={str(int(top[1])): -100})
    out = sampler(logits, [forced, banned])
    assert out[0].item() == 17
    assert out[1].item() != top[1].item() and out[1].item() == logits[1].topk(2).indices[1].item()
    seeded = SamplingParams(temperature=1.0, seed=1, logit_bias={"17": 100})
    draws = {sampler(logits[:1], [seeded], generators=[make_generator(s)]).item() for s in range(20)}
    assert draws == {17}


def test_min_p_keeps_tokens_within_a_fraction_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = apply_min_p(logits.clone(), torch.tensor([0.15]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, True, False, False]  # 0.075 is the floor
    assert torch.isfinite(apply_min_p(logits.clone(), torch.tensor([0.0]))).all()
    assert torch.isfinite(apply_min_p(logits.clone(), torch.tensor([1.0]))[0]).tolist() == [True] + [False] * 4
    wide = torch.zeros(1, VOCAB)
    wide[0, :5] = logits[0]
    wide[0, 5:] = -30.0
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, min_p=0.15, seed=0)]
    draws = {sampler(wide, params, generators=[make_generator(s)]).item() for s in range(200)}
    assert draws == {0, 1, 2}


def test_min_tokens_suppresses_eos():
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 50.0
    sampler = Sampler(eos_token_ids=[EOS])
    params = [SamplingParams(temperature=0.0, min_tokens=3)] * 2
    out = sampler(logits, params, num_generated=[2, 3])
    assert out[0].item() != EOS
    assert out[1].item() == EOS
    sampled = sampler(
        logits[:1], [SamplingParams(temperature=1.0, min_tokens=1, seed=0)], num_generated=[0], generators=[make_generator(0)]
    )
    assert sampled.item() != EOS


def test_mixed_batch_shapes_and_errors():
    sampler = Sampler()
    logits = rand_logits(3)
    out = sampler(logits, [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=3)])
    assert out.shape == (3,) and out.dtype == torch.long
    assert out[0].item() == logits[0].argmax().item()
    assert out[2].item() in logits[2].topk(3).indices.tolist()
    with pytest.raises(ValueError, match="2 params for 3 rows"):
        sampler(logits, [SamplingParams()] * 2)


@pytest.mark.parametrize("candidates", [None, 3])
def test_top_k_top_p_match_transformers_warpers(monkeypatch, candidates):
    """Same kept set as TopKLogitsWarper then TopPLogitsWarper, row by row; with 3
    candidates most nuclei are wider, so the full-sort fallback is checked too."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from python_backends.generation import sampling

    if candidates:
        monkeypatch.setattr(sampling, "_NUCLEUS_CANDIDATES", candidates)
    logits = rand_logits(60, seed=11)
    settings = [(k, p) for k in (0, 1, 5, 50) for p in (0.05, 0.3, 0.6, 0.9, 0.99)]
    top_k = torch.tensor([settings[i % len(settings)][0] for i in range(60)])
    top_p = torch.tensor([settings[i % len(settings)][1] for i in range(60)])
    ours = apply_top_k_top_p(logits, top_k, top_p)
    wide = 0
    for b in range(60):
        ref = logits[b : b + 1].clone()
        if top_k[b] > 0:
            ref = TopKLogitsWarper(int(top_k[b]))(None, ref)
        ref = TopPLogitsWarper(float(top_p[b]))(None, ref)
        kept = torch.isfinite(ours[b])
        assert torch.equal(kept, torch.isfinite(ref[0])), (b, int(top_k[b]), float(top_p[b]))
        assert torch.equal(ours[b][kept], logits[b][kept])  # kept logits are untouched
        wide += int(kept.sum()) > 3
    assert wide > 10


def test_sampling_follows_the_distribution():
    """Frequencies over many seeded draws match the softmax (a broken CDF inversion,
    off by one token, fails this)."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, float("-inf"), 0.5]])
    probs = torch.softmax(logits, -1)[0]
    sampler, p = Sampler(), SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(0)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[sampler(logits, [p], generators=[gen]).item()] += 1
    assert counts[4] == 0
    assert (counts / 4000 - probs).abs().max().item() < 0.03


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_alone_and_batched():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the same code path runs on the CPU in the tests above")
    sampler = Sampler()
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7)
    logits = [rand_logits(3, seed=s).cuda() for s in range(10)]
    gen_alone, gen_batched = make_generator(7, "cuda"), make_generator(7, "cuda")
    alone = [sampler(x[:1], [p], generators=[gen_alone]).item() for x in logits]
    batched = [
        sampler(x, [p, SamplingParams(), SamplingParams(temperature=0.0)], generators=[gen_batched, None, None])[0].item()
        for x in logits
    ]
    assert alone == batched


def test_sampling_defaults_come_from_the_model_then_the_operator():
    from contract.errors import ConfigError
    from python_backends.generation.sampling import sampling_defaults

    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "bos_token_id": 1}
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 50}
    assert sampling_defaults({**model, "do_sample": False})["temperature"] == 0.0
    assert sampling_defaults(model, '{"temperature": 0.2, "top_p": 0.9}') == {"temperature": 0.2, "top_p": 0.9, "top_k": 50}
    for bad, words in (
        ('{"temperature": -1}', "temperature"),
        ('{"max_tokens": 5}', "max_tokens"),
        ('{"nope": 1}', "nope"),
        ("[1]", "JSON object"),
        ("{", "valid JSON"),
    ):
        with pytest.raises(ConfigError, match=words):
            sampling_defaults({}, bad)


def test_a_request_that_leaves_a_field_out_gets_the_models_default():
    defaults = {"temperature": 0.2, "top_p": 0.9}
    plain = parse_sampling_params({}, max_tokens_limit=2048, defaults=defaults)
    assert (plain.temperature, plain.top_p) == (0.2, 0.9)
    given = parse_sampling_params({"temperature": 1.0, "top_p": None}, max_tokens_limit=2048, defaults=defaults)
    assert (given.temperature, given.top_p) == (1.0, 0.9)  # null: the default, as when left out
    assert parse_sampling_params({}, max_tokens_limit=2048).temperature == 1.0  # no model default: the field's

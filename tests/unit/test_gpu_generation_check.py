"""tests.gpu.generation_check: its comparison code on the CPU with a 2-layer random Llama, and the
real check on CUDA where there is a GPU (skipped with the reason otherwise).

The CPU run is the same code path the GPU run takes (engine and transformers on the same
random weights, FP32 tokens compared one by one); feeding the engine slightly different weights
shows the check fails when it should.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.gpu import generation_check as check

PROMPT_LENGTHS = (5, 19, 40)  # 40 tokens with a 16-token block: a partial last block
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(2)
    return check.build_checkpoint(tmp_path_factory.mktemp("tiny") / "model", check.TINY)


@pytest.fixture(scope="module")
def perturbed_dir(tiny_dir, tmp_path_factory):
    """The same checkpoint with the two KV heads of one layer's V swapped: a GQA mapping bug."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("perturbed") / "model"
    shutil.copytree(tiny_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    v = state["model.layers.1.self_attn.v_proj.weight"]
    d = check.TINY["head_dim"]
    v[:d], v[d : 2 * d] = v[d : 2 * d].clone(), v[:d].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_compare_tokens_counts_the_matching_prefix_and_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]  # equal again after diverging: not counted
    parity, firsts = check.compare_tokens("m", ref, got)
    assert firsts == [None, 2, 0]
    assert parity.matching_prefix == pytest.approx((4 + 2 + 0) / 12)
    assert (parity.prompts_identical, parity.num_prompts, parity.first_divergence) == (1, 3, 0)
    assert not parity.identical
    short, firsts = check.compare_tokens("m", [[1, 2, 3]], [[1, 2]])  # a missing token is a divergence
    assert firsts == [2] and not short.identical
    same, _ = check.compare_tokens("m", ref, [list(r) for r in ref])
    assert same.identical and same.matching_prefix == 1.0 and same.first_divergence is None
    with pytest.raises(ValueError):
        check.compare_tokens("m", ref, got[:2])


def test_fp32_parity_on_cpu_is_exact(tiny_dir):
    results = check.run_checks(
        tiny_dir,
        torch.device("cpu"),
        ["float32"],
        prompt_lengths=PROMPT_LENGTHS,
        new_tokens=NEW_TOKENS,
        throughput=False,
        log=lambda _: None,
    )
    (res,) = results
    assert [p.mode.split(" (")[0] for p in res.parity] == [
        "engine one at a time",
        "engine batched",
        "engine batched, prefix hits",
    ]
    for p in res.parity:
        assert p.identical, p
        assert p.matching_prefix == 1.0
    assert res.logits_max_abs_diff <= check.FP32_LOGITS_TOL
    assert res.logits_max_abs > 0.1  # real logits were compared, not empty rows
    assert res.passed() and check.fp32_failures(results) == []
    assert all(len(r) == NEW_TOKENS for r in res.reference)
    # The random model is not degenerate: its greedy tokens change with the context (at
    # transformers' default init scale each prompt repeats one token, whatever the attention).
    assert res.reference_distinct > 0.75, res.reference
    report = check.format_report(results)
    assert "| float32 | engine one at a time | 100.0 % | 3/3 | - |" in report


def test_fp32_parity_fails_when_the_engine_runs_other_weights(tiny_dir, perturbed_dir):
    res = check.check_parity(
        tiny_dir,
        torch.device("cpu"),
        "float32",
        check.make_prompts(PROMPT_LENGTHS, check.TINY["vocab_size"], check.SEED),
        NEW_TOKENS,
        engine_model_dir=perturbed_dir,
    )
    assert res.logits_max_abs_diff > check.FP32_LOGITS_TOL
    assert not res.passed()
    failures = check.fp32_failures([res])
    assert any("logits differ" in f for f in failures), failures
    # The divergence is located and the reference's logit gap there is reported (positive:
    # the reference preferred its own token).
    for p in res.parity:
        assert not p.identical, p
        assert p.first_divergence is not None and p.gap_at_divergence > 0, p
    assert any("prompts differ" in f for f in failures), failures


def test_throughput_rows_on_cpu(tiny_dir):
    rows = check.measure_throughput(tiny_dir, torch.device("cpu"), "float32", streams=(1, 2), new_tokens=4, serial_requests=1)
    assert [r["streams"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("engine_tok_s", "hf_static_batch_tok_s", "hf_one_at_a_time_tok_s"):
            assert r[key] > 0, (key, r)
        assert r["engine_preemptions"] == 0


def test_without_cuda_the_script_skips(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check runs for real in test_check_on_cuda")
    assert check.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("skipped: ") and "NVIDIA GPU" in out


@pytest.mark.gpu
def test_check_on_cuda(tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the same comparison runs on the CPU in the tests above")
    out_file = tmp_path / "result.json"
    code = check.main(["--tiny", "--streams", "1,8", "--throughput-tokens", "16", "--out", str(out_file)])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert "float32 parity: passed" in out
    assert out_file.is_file()


def test_runner_checks_slots_once_on_the_host(tiny_dir):
    """The runner validates a step's slots itself (the cache skips its per-layer device checks)."""
    from python_backends.generation.model_runner import LlamaWeights, ModelRunner
    from python_backends.generation.paged_attention import slots_for_positions

    runner = ModelRunner(LlamaWeights.from_folder(tiny_dir), num_blocks=4, block_size=16, max_model_len=64)
    plan = runner.cache.plan([[1]], [3], [3], check.TINY["num_attention_heads"])
    for bad in ([0, 1, 64], [-1, 0, 1]):
        with pytest.raises(IndexError, match=r"slots must be in \[0, 64\)"):
            runner.forward([5, 6, 7], [0, 1, 2], bad, plan, [2])
    assert all(float(k.abs().sum()) == 0 for k in runner.cache.k_cache)  # nothing written
    logits = runner.forward([5, 6, 7], [0, 1, 2], slots_for_positions([1], range(3), 16), plan, [2])
    assert logits.shape == (1, check.TINY["vocab_size"]) and logits.dtype == torch.float32
    assert float(runner.cache.k_cache[0][1, :3].abs().sum()) > 0

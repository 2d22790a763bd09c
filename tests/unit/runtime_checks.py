"""What the compiled runtimes' tests share (test_generation_llama_cpp.py, test_generation_openvino.py):
the engine's prompts, a run of requests to the end, and the comparison of greedy streams that allows
a runtime's batch-dependent rounding and nothing else."""

from __future__ import annotations

from python_backends.generation.engine import LLMEngine
from python_backends.generation.sampling import SamplingParams

PROMPTS = [
    "The three primary colours are",
    "Écris une phrase sur la mer.",
    "def fibonacci(n):",
    "Die Hauptstadt von Deutschland ist",
    "Once upon a time, in a small village by the sea,",
    "SELECT name FROM users WHERE",
]
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, in the language of the question, "
    "without lists, code or greetings, and never repeat the question. "
)


def run_all(engine: LLMEngine, prompts, params: SamplingParams, prefix="r", logprobs=None) -> dict[str, list[int]]:
    """Every prompt's tokens per choice (``"<prompt>/<choice>"``), the engine stepped until done."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            key = f"{o.request_id.removeprefix(prefix)}/{o.index}"
            out.setdefault(key, []).extend(o.token_ids)
            if logprobs is not None:
                logprobs.setdefault(key, []).extend(o.logprobs or [])
    return out


def same_until_a_near_tie(expected, margins, got, tie=0.1) -> None:
    """A compiled runtime is not batch-invariant (a batch's products take other kernels than one row's),
    so two runs of the same greedy stream in different batches may part, but only where the reference's
    two most likely tokens were within ``tie`` nats of each other: anywhere else a difference is a fault."""
    for key, tokens in expected.items():
        for i, (a, b) in enumerate(zip(tokens, got[key])):
            if a != b:
                assert margins[key][i] < tie, (key, i, margins[key][i], tokens, got[key])
                break
        else:
            assert len(tokens) == len(got[key]), key


def margins(logprobs) -> dict[str, list[float]]:
    """Per stream, each position's gap between the two most likely tokens (logprobs=2)."""
    return {k: [e.top[0][1] - e.top[1][1] for e in v] for k, v in logprobs.items()}


def continue_after_each_cut(engine: LLMEngine, prompt: str, params: SamplingParams, cuts=(1, 6)) -> None:
    """A stream continued with its first pieces' token ids as ``prefix_ids`` (a replica died) gives
    the uninterrupted run's tokens: on a runtime that is not batch-invariant the prefix is prefilled
    in one batch where the uninterrupted run decoded it row by row, so the two may part, but only at
    a near tie of the uninterrupted run (greedy ``params``)."""
    from dataclasses import replace

    whole, logprobs = [], {}
    engine.add_request("whole", prompt, replace(params, logprobs=2))
    while engine.has_unfinished():
        for o in engine.step():
            whole.append(o)
            logprobs.setdefault("0/0", []).extend(o.logprobs or [])
    expected = {"0/0": [t for o in whole for t in o.token_ids]}
    for cut in cuts:
        prefix = [t for o in whole[:cut] for t in o.token_ids]
        engine.add_request("rest", prompt, params, prefix_ids=prefix)
        rest = []
        while engine.has_unfinished():
            rest += engine.step()
        assert rest[-1].num_output_tokens == whole[-1].num_output_tokens
        same_until_a_near_tie(expected, margins(logprobs), {"0/0": prefix + [t for o in rest for t in o.token_ids]})

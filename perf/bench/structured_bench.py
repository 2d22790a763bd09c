"""Structured outputs through the whole stack (tritonserver + the OpenAI gateway, the official
``openai`` SDK): how often an answer is a valid object with and without the engine enforcing
the schema, and what enforcing costs in tokens/s at 16 streams.

1. **Validity**: ``--prompts`` varied requests (people of many jobs and cities, several languages)
   for a Pydantic model, enforced (``chat.completions.parse(response_format=Person)``: the schema
   becomes the engine's guide) and not (the schema spelled out in the system message, the answer
   parsed with ``Person.model_validate_json``, a code fence forgiven), at the default sampling.
2. **Cost**: ``--streams`` concurrent requests of ``--max-tokens`` tokens, alternating rounds with
   and without a JSON-schema guide (a long string, so every request runs to ``max_tokens`` as the
   unguided ones do with ``ignore_eos``): tokens/s, P50/P99/max, guided / unguided (target >= 0.9).
3. **Fit** (``--fit``, alone): 5 Pydantic models with unbounded lists and strings x 10 prompts at
   max_tokens 160, temperature 0.7, with and without ``fit_structure_to_max_tokens``: answers the
   SDK's ``parse()`` accepts, tokens, and the fitting's cost per token (the answers replayed in process).

    python -m perf.bench.structured_bench [--prompts 50] [--streams 16] [--max-tokens 64] [--rounds 3] [--fit]
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

from perf.lib import options, report
from perf.lib.stats import percentile_of

MODEL = "text_generation"
KEY = "structured-bench-key"
TARGET = 0.9
JOBS = ["baker", "pilot", "nurse", "painter", "teacher", "farmer", "chemist", "poet", "judge", "sailor"]
PLACES = ["Lisbon", "Nairobi", "Osaka", "Lima", "Oslo"]
ASKS = [
    "Describe a {job} from {place}.",
    "Invent a {job} who lives in {place}.",
    "Tell me about a retired {job} in {place}.",
    "Décris un {job} qui habite à {place}.",
    "Beschreibe eine Person ({job}) aus {place}.",
]
LONG_TEXT = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}


def person_model():
    import pydantic

    # Every field bounded (a small model can loop inside an unbounded string: the answer is then cut
    # by max_tokens, valid so far but not finished).
    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=40)
        age: int = pydantic.Field(ge=0, le=130)
        job: str = pydantic.Field(max_length=40)
        city: str = pydantic.Field(max_length=40)
        hobbies: list[Annotated[str, pydantic.StringConstraints(max_length=30)]] = pydantic.Field(max_length=4)

    return Person


def prompts(n: int) -> list[str]:
    pairs = itertools.product(ASKS, JOBS, PLACES)
    return [ask.format(job=job, place=place) for ask, job, place in itertools.islice(pairs, n)]


def unfenced(text: str) -> str:
    """The answer without a Markdown code fence around it."""
    text = text.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1].rsplit("```", 1)[0] if "\n" in text else ""
    return text.strip()


def validity(client, person, asks: list[str], max_tokens: int) -> list[dict]:
    """Valid answers out of ``asks`` with the schema enforced and with it only asked for."""
    import pydantic

    schema = json.dumps(person.model_json_schema())
    system = f"Answer with one JSON object only, matching this JSON schema:\n{schema}"

    def enforced(prompt):
        r = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=person, max_tokens=max_tokens
        )
        return isinstance(r.choices[0].message.parsed, person)

    def free(prompt):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt}],
            max_tokens=max_tokens,
        )
        try:
            person.model_validate_json(unfenced(r.choices[0].message.content or ""))
        except pydantic.ValidationError:
            return False
        return True

    out = []
    with ThreadPoolExecutor(16) as pool:
        for name, fn in (("enforced", enforced), ("not enforced", free)):
            start = time.perf_counter()
            ok = list(pool.map(fn, asks))
            out.append({"kind": name, "valid": sum(ok), "total": len(ok), "seconds": round(time.perf_counter() - start, 1)})
    return out


def cost(client, streams: int, max_tokens: int, rounds: int) -> list[dict]:
    question = [{"role": "user", "content": "Write a long story about the sea."}]
    kinds = {
        "no guide": {"extra_body": {"ignore_eos": True}},
        "json schema": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": LONG_TEXT}},
            "extra_body": {"ignore_eos": True},
        },
    }

    def one(kw):
        start = time.perf_counter()
        r = client.chat.completions.create(model=MODEL, messages=question, max_tokens=max_tokens, temperature=0.7, **kw)
        return r.usage.completion_tokens, time.perf_counter() - start

    rows: dict[str, dict[str, Any]] = {k: {"tokens": 0, "seconds": 0.0, "latencies": []} for k in kinds}
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, [kinds["no guide"]] * 2))  # warm
        for _ in range(rounds):
            for name, kw in kinds.items():
                start = time.perf_counter()
                done = list(pool.map(one, [kw] * streams))
                rows[name]["seconds"] += time.perf_counter() - start
                rows[name]["tokens"] += sum(t for t, _ in done)
                rows[name]["latencies"] += [s for _, s in done]
    return [
        {
            "kind": name,
            "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
            "p50_s": round(percentile_of(r["latencies"], 50), 2),
            "p99_s": round(percentile_of(r["latencies"], 99), 2),
            "max_s": round(max(r["latencies"]), 2),
            "tokens": r["tokens"],
        }
        for name, r in rows.items()
    ]


SUBJECTS = ["Japan", "Brazil", "Kenya", "Norway", "Peru", "India", "Egypt", "Canada", "Italy", "Vietnam"]


def fit(client, streams: int) -> list[dict]:
    """5 asks x SUBJECTS (a model per ask, lists and strings unbounded) parsed with and without
    fit_structure_to_max_tokens; the fitting's cost per token, the answers replayed in process."""
    import openai
    from pydantic import create_model as model
    from transformers import AutoTokenizer

    from python_backends.generation.structured import Grammars
    from server.layout import ROOT

    district = model("District", name=(str, ...), landmarks=(list[str], ...))
    asks = {
        "List the countries near {s} as JSON.": model("Near", region=(str, ...), countries=(list[str], ...)),
        "Describe a person from {s} and all their hobbies in JSON.": model("Person", name=(str, ...), age=(int, ...), hobbies=(list[str], ...)),
        "Give a recipe from {s} with every ingredient and step in JSON.": model("Recipe", title=(str, ...), ingredients=(list[str], ...), steps=(list[str], ...)),
        "Describe the biggest city of {s}, its districts and landmarks, in JSON.": model("City", name=(str, ...), districts=(list[district], ...)),  # type: ignore[valid-type]
        "Give the monthly rainfall of {s} over ten years in JSON.": model("Rain", place=(str, ...), rainfall_mm=(list[float], ...)),
    }  # fmt: skip
    jobs = [(m, a.format(s=s), on) for a, m in asks.items() for s in SUBJECTS for on in (False, True)]

    def one(job):  # (option, parsed, tokens, fitted, (model, answer) when parsed)
        m, prompt, on = job
        body = {"fit_structure_to_max_tokens": True} if on else None
        try:
            r = client.chat.completions.parse(
                model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=m, max_tokens=160, temperature=0.7, extra_body=body
            )  # fmt: skip
        except openai.LengthFinishReasonError as exc:
            return on, False, getattr(exc.completion.usage, "completion_tokens", 160), False, None
        c, fitted = r.choices[0], bool((r.choices[0].model_extra or {}).get("structure_fitted"))
        return on, c.message.parsed is not None, r.usage.completion_tokens, fitted, (m, c.message.content)

    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(one, jobs))
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "model_repository" / MODEL / "1"))
    grammars, seconds, tokens = Grammars(tokenizer, 49152), [0.0, 0.0], 0
    for m, answer in (d[4] for d in done if d[0] and d[4]):
        ids = tokenizer.encode(answer, add_special_tokens=False)
        tokens += len(ids)
        for k in (0, 1):  # the guide alone, then through Fitting.take
            matcher, f = grammars.matcher("guided_json", json.dumps(m.model_json_schema())), grammars.fitting("guided_json")
            start = time.perf_counter()
            for i, t in enumerate(ids):
                f.take(matcher, t, i, 160) if k else matcher.consume_token(t)
            seconds[k] += time.perf_counter() - start
    extra = round(1e6 * (seconds[1] - seconds[0]) / max(1, tokens), 1)
    return [
        {"option": on, "parsed": sum(d[1] for d in r), "total": len(r), "fitted": sum(d[3] for d in r),
         "mean_tokens": round(sum(d[2] for d in r) / len(r), 1), "extra_us_per_token": extra if on == "on" else 0.0}
        for on, r in (("off", [d for d in done if not d[0]]), ("on", [d for d in done if d[0]]))
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("perf.bench.structured_bench", __doc__)
    parser.add_argument("--prompts", type=int, default=50, help="validity prompts (default 50)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests of the cost run (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the cost run (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the cost run (default 3)")
    parser.add_argument("--results", type=Path, help="output folder (default perf/results/structured-<UTC time>)")
    parser.add_argument("--fit", action="store_true", help="the fit_structure_to_max_tokens run alone")
    args = parser.parse_args(argv)

    import openai

    from perf.lib.deployment import start_deployment

    with tempfile.TemporaryDirectory(prefix="structured-bench-") as tmp:
        deployment = start_deployment([MODEL], Path(tmp), KEY, False, report.progress())
        assert deployment.gateway is not None
        try:
            client = openai.OpenAI(base_url=f"{deployment.gateway.url}/v1", api_key=KEY, max_retries=0, timeout=600)
            if args.fit:
                rows = fit(client, args.streams)
                summary = "# fit_structure_to_max_tokens\n\n" + report.table(list(rows[0]), (list(r.values()) for r in rows))
                report.write(report.results_dir(args.results, "structured-fit"), summary, say=print)
                return 0
            valid = validity(client, person_model(), prompts(args.prompts), 200)
            rows = cost(client, args.streams, args.max_tokens, args.rounds)
        finally:
            deployment.stop()
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    summary = "\n\n".join(
        [
            f"# Structured outputs\n\nValidity over {args.prompts} prompts (a Pydantic model of 5 fields, default sampling):",
            report.table(list(valid[0]), (list(r.values()) for r in valid)),
            f"Cost at {args.streams} streams, {args.max_tokens} tokens each, {args.rounds} alternating rounds (seconds a request):",
            report.table(list(rows[0]), (list(r.values()) for r in rows)),
            f"Guided / unguided tokens/s: {ratio:.2f} (target >= {TARGET})\n",
        ]
    )
    csvs = {"structured_cost.csv": rows, "structured_validity.csv": valid}
    report.write(report.results_dir(args.results, "structured"), summary, csvs=csvs, say=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())

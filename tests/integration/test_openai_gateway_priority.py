"""Priority classes on generation through the gateway and tritonserver: the X-Priority-Class header
of /v1/chat/completions, /v1/completions and /v1/responses reaches the engine (which checks it: a
bad value is a 400 naming the header), and under a bulk flood interactive requests are admitted
ahead of the waiting bulk ones (config.pbtxt's max_running_bulk leaves them places), so they
finish before the flood's tail. Ordering is asserted, not wall-clock time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.metrics_text import metric_sum, scrape

GENERATION = "text_generation"
HEADER = "X-Priority-Class"
BULK_REQUESTS = 24  # max_running_bulk (16) run, 8 wait
INTERACTIVE_REQUESTS = 2
TOKENS = 12


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_a_bad_class_is_a_400_naming_the_header(openai_client, route):
    bad = {"extra_headers": {HEADER: "urgent"}}
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            openai_client.chat.completions.create(
                model=GENERATION, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **bad
            )
        elif route == "completions":
            openai_client.completions.create(model=GENERATION, prompt="Hi", max_tokens=2, **bad)
        else:
            openai_client.responses.create(model=GENERATION, input="Hi", max_output_tokens=2, **bad)
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == HEADER, body
    assert "interactive, default, bulk" in str(body.get("message")) and "urgent" in str(body.get("message"))


def test_each_class_is_served(openai_client):
    for cls in ("interactive", "Default", "BULK"):
        answer = openai_client.completions.create(
            model=GENERATION, prompt="The sky is", max_tokens=2, extra_headers={HEADER: cls}
        )
        assert answer.choices[0].text is not None and answer.usage.completion_tokens == 2


def test_interactive_requests_finish_before_a_bulk_floods_tail(openai_client, triton):
    finished: list[str] = []
    lock = threading.Lock()

    def complete(name: str, cls: str) -> None:
        openai_client.completions.create(
            model=GENERATION,
            prompt=f"Write a list of numbers ({name}):",
            max_tokens=TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={HEADER: cls},
        )
        with lock:
            finished.append(name)

    def waiting(cls: str) -> float:
        return metric_sum(scrape(triton.metrics_url), "llm_num_requests_waiting_by_class", model=GENERATION, priority_class=cls)

    with ThreadPoolExecutor(BULK_REQUESTS + INTERACTIVE_REQUESTS) as pool:
        flood = [pool.submit(complete, f"bulk{i}", "bulk") for i in range(BULK_REQUESTS)]
        for _ in range(600):  # the flood is queued in the engine: bulk sequences wait for places
            if waiting("bulk") > 0 or all(f.done() for f in flood):
                break
            threading.Event().wait(0.05)
        assert waiting("bulk") > 0, "the bulk flood never waited (max_running_bulk in config.pbtxt?)"
        chats = [pool.submit(complete, f"chat{i}", "interactive") for i in range(INTERACTIVE_REQUESTS)]
        for f in flood + chats:
            f.result(timeout=300)
    last_chat = max(finished.index(f"chat{i}") for i in range(INTERACTIVE_REQUESTS))
    after = [name for name in finished[last_chat:] if name.startswith("bulk")]
    # The waiting bulk sequences (BULK_REQUESTS - 16) are admitted only as the running ones end,
    # after the interactive ones: in FIFO order the chats would come last.
    assert len(after) >= BULK_REQUESTS // 4, finished
    assert waiting("bulk") == 0 and waiting("interactive") == 0

"""The official ``openai`` Python client against the server on a real loopback port
(uvicorn in a thread, the tiny chat engine of test_serve.py): completions and chat,
streamed and not, ``n``, stop, usage, and the server's errors arriving as the client's
own exception types (400, 401, 429). Skips where ``openai`` is not installed (it is in
the ``test`` extra)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("openai", reason="the openai client is not installed (the test extra has it)")

import openai
from engine_utils import wait_idle
from test_serve import MESSAGES, chat_engine
from test_serve_tools import serving

from torch_topg.serve import create_app

MODEL = "tiny-llama"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served():
    """``(client, engine)``: an ``openai.OpenAI`` client on the served app."""
    with chat_engine() as eng, serving(create_app(eng, MODEL)) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            yield client, eng


@pytest.fixture(autouse=True)
def whole_pool_after(served):
    yield
    engine = served[1]
    wait_idle(engine)
    engine.pool.check_whole()


def test_completions(served) -> None:
    client, engine = served
    want = engine.generate("Hello", max_new_tokens=6, temperature=0, ignore_eos=True)[0]
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, **GREEDY)
    assert c.object == "text_completion" and c.model == MODEL
    (choice,) = c.choices
    assert choice.text == want.text and choice.finish_reason == "length"
    assert c.usage.completion_tokens == 6 and c.usage.prompt_tokens == want.prompt_tokens
    assert c.usage.total_tokens == want.prompt_tokens + 6
    # after engine.generate of the same prompt: what its repeat reads from the prefix cache
    again = engine.generate("Hello", max_new_tokens=1)[0].cached_prompt_tokens
    assert c.usage.prompt_tokens_details.cached_tokens == again


def test_completions_stop_and_n(served) -> None:
    client, _ = served
    free = client.completions.create(model=MODEL, prompt="The sky", max_tokens=16, **GREEDY)
    text = free.choices[0].text
    stop = text[2:4]
    cut = client.completions.create(
        model=MODEL, prompt="The sky", max_tokens=16, stop=[stop], **GREEDY
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    sampled = client.completions.create(
        model=MODEL, prompt="ab", max_tokens=4, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(ch.index for ch in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == 12


def test_chat_streamed_equals_not_streamed(served) -> None:
    client, _ = served
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stream(served) -> None:
    client, _ = served
    full = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, **GREEDY)
    parts = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=8, stream=True, **GREEDY
    )
    assert "".join(ch.choices[0].text for ch in parts) == full.choices[0].text


def test_chat_n_and_logprobs(served) -> None:
    client, _ = served
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=2, logprobs=True, top_logprobs=2, **GREEDY
    )
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_errors_are_the_clients_exceptions(served) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError, match="name") as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES,
            tools=[{"type": "function", "function": {"parameters": {}}}],
        )  # fmt: skip
    assert e.value.status_code == 400 and e.value.param == "tools[0].function.name"
    assert e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)


def test_api_key_401() -> None:
    with chat_engine() as eng, serving(create_app(eng, MODEL, api_key="sekret")) as url:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        c = good.completions.create(model=MODEL, prompt="hi", max_tokens=2, **GREEDY)
        assert c.usage.completion_tokens == 2


def test_full_queue_429() -> None:
    """One request of 40 prompts on an engine that runs one sequence at a time and lets one
    wait: the queue fills, the whole request is refused (its submitted prompts aborted)."""
    with chat_engine(max_queue=1, max_batch_size=1) as eng:
        with serving(create_app(eng, MODEL)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError, match="queue is full") as e:
                client.completions.create(model=MODEL, prompt=["hi"] * 40, max_tokens=50)
            assert e.value.status_code == 429 and e.value.type == "rate_limit_error"
            assert e.value.response.headers["retry-after"] == "1"
            wait_idle(eng)
            eng.pool.check_whole()
            assert eng.stats()["requests"]["failed"] == 0

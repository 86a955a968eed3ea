"""The official `openai` Python SDK, pointed at the router, works for chat and completions, streaming or
not: the proof that we are OpenAI-compatible for real clients, not only for our own tests."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import MODEL


@pytest.fixture
async def client(make_engine, make_router):
    engines = [await make_engine("gpu-0"), await make_engine("gpu-1")]
    router = await make_router(engines)
    async with openai.AsyncOpenAI(base_url=router.ingress_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_chat_completion(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.choices[0].message.content == "tok0 tok1 tok2 "
    assert reply.usage is not None and reply.usage.completion_tokens == 3


async def test_chat_completion_streaming(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices[0].delta.content]
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]


async def test_completion(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=2)
    assert reply.choices[0].text == "tok0 tok1 "


async def test_completion_streaming(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=3, stream=True)
    assert "".join([chunk.choices[0].text async for chunk in stream]) == "tok0 tok1 tok2 "


async def test_unknown_model_raises_not_found_with_the_message(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    assert MODEL in info.value.message


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    assert [m.id async for m in client.models.list()] == [MODEL]

"""The server driven by the `openai` Python client, as users drive it: sync and async, whole
and streamed, chat and completions, logprobs and echo, the session field, an error."""

import asyncio

import openai
import pytest

MODEL = "random:tiny"


def test_the_sync_client_chats_completes_streams_and_reads_logprobs(live):
    client = live.client()
    chat = client.chat.completions.create(model=MODEL, user="oa-1", max_tokens=5, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert chat.usage.completion_tokens >= len(content) and all(len(t.top_logprobs) == 2 for t in content)
    completion = client.completions.create(model=MODEL, prompt="one two", max_tokens=3, logprobs=2, echo=True,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    # a text prompt: the server put the BOS before it, so its first token has a log-probability too
    assert choice.text.startswith("one two") and choice.logprobs.token_logprobs[0] < 0
    assert len(choice.logprobs.tokens) == len(choice.logprobs.text_offset) == len(choice.logprobs.top_logprobs)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="a", max_tokens=4, stream=True,
                                                                   user="oa-2", extra_body={"ignore_eos": True})
              if c.choices]
    assert len("".join(pieces)) > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"tools": [{"x": 1}]})
    assert refused.value.body["param"] == "tools"


def test_the_async_client_streams_a_chat_with_logprobs(live):
    async def chat() -> tuple[str, int]:
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        text, tokens = "", 0
        stream = await client.chat.completions.create(model=MODEL, user="oa-3", max_tokens=6, stream=True,
                                                      logprobs=True, messages=[{"role": "user", "content": "yo"}],
                                                      extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                tokens += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        await client.close()
        return text, tokens

    text, tokens = asyncio.run(chat())
    assert tokens == 6 and text

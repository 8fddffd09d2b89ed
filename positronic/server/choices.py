"""`n` > 1 or a list of prompts: several choices for one request, each a throwaway sequence of its own.

OpenAI's `n` asks for several answers to one prompt; a completion's `prompt` may list several
prompts (vLLM's and OpenAI's batch: choice i * n + j is prompt i's choice j). Here choice i is exactly what the same
request with `n` = 1 and seed `seed + i` answers (the request's seed, or the server's when it
gives none: so choice 0 is the answer `n` = 1 gives). The choices are separate requests inside
the server, one throwaway conversation each, run side by side: their ticks share the batched
forwards as concurrent requests do. What is merged here is only the answer on the wire:

- whole: one object with `choices[i]` (index i), the first choice's id; `usage` counts the
  prompt once and every choice's completion tokens (OpenAI's rule); `positronic.choices`
  lists each choice's sequence state;
- streamed: every choice's chunks as they come, with their index and one id; one usage chunk
  at the end (if asked) and one `data: [DONE]`.
"""

from __future__ import annotations

import asyncio

DONE = "[DONE]"


def merged_usage(usages: list[dict], n: int) -> dict:
    """Each prompt once (its `n` choices read the same one; usages in prompt order, n each),
    the completions summed."""
    prompt = sum(usage["prompt_tokens"] for usage in usages[::n])
    completion = sum(usage["completion_tokens"] for usage in usages)
    merged = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if "prompt_tokens_pruned" in usages[0]:
        merged["prompt_tokens_pruned"] = sum(usage.get("prompt_tokens_pruned", 0) for usage in usages[::n])
    return merged


def merge_whole(answers: list[dict], n: int) -> dict:
    """Whole answers of `n` = 1, one per choice in order (`n` per prompt) -> one answer with every choice."""
    merged = dict(answers[0])
    merged["choices"] = [{**answer["choices"][0], "index": index} for index, answer in enumerate(answers)]
    merged["usage"] = merged_usage([answer["usage"] for answer in answers], n)
    merged["positronic"] = {"choices": [answer["positronic"] for answer in answers]}
    return merged


async def merge_events(streams: list, include_usage: bool, n: int):
    """The payloads of one streamed `n` = 1 answer per choice (`replies.events`, each asked
    with include_usage so that the merged usage can be counted) -> one answer's payloads. A
    choice's error body is passed on as it is. Closing this iterator (the client left) closes
    every choice's, so each lets go of its conversation at once."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, payloads) -> None:
        try:
            async for payload in payloads:
                await queue.put((index, payload))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(index, payloads)) for index, payloads in enumerate(streams)]
    first_id, usages, last, running = None, {}, None, len(tasks)
    try:
        while running:
            index, chunk = await queue.get()
            if chunk is None:
                running -= 1
                continue
            if chunk == DONE:
                continue
            if "choices" not in chunk:  # an error body
                yield chunk
                continue
            first_id = first_id or chunk["id"]
            chunk = {**chunk, "id": first_id}
            if chunk.get("usage") is not None and not chunk["choices"]:
                usages[index] = chunk["usage"]  # by choice: each prompt's first counts its prompt
                last = chunk
                continue
            chunk["choices"] = [{**choice, "index": index} for choice in chunk["choices"]]
            yield chunk
        if include_usage and last is not None and len(usages) == len(streams):
            yield {**last, "usage": merged_usage([usages[index] for index in range(len(streams))], n)}
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for payloads in streams:
            await payloads.aclose()

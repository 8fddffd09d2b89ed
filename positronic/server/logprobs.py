"""Token log-probabilities for the answers: `logprobs` and `echo` on /v1/completions (the
OpenAI completions API's shape, as vLLM returns it, which lm-evaluation-harness reads) and
`logprobs` / `top_logprobs` on chat.

A generated token's log-probability is the model's own, from the logits it was drawn from
(before the request's sampling settings: vLLM's "raw" logprobs). An echoed prompt token's is
exact where the prompt is prefilled (a plain forward over it: one prefill of at most the
budget), and comes from teacher forcing through the session's bounded cache where the prompt is
read token by token (a running session's prompt, or a fresh one past the budget): what the
session's memory gives it, as `eval` measures; `positronic.logprobs` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class TokenLogprob:
    """One token, its log-probability (None: the first token, which nothing predicts), and the
    `top` most likely alternatives at its place (id, log-probability), most likely first."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def of_logits(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """`token_id`'s entry from the logits [vocab] that predicted it."""
    logprobs = torch.log_softmax(logits.detach().to("cpu", torch.float32), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    return TokenLogprob(token_id, float(logprobs[token_id]),
                        () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist())))


@torch.no_grad()
def of_prompt(lm, ids: list[int], top: int) -> list[TokenLogprob]:
    """Every token of `ids` with its log-probability given the tokens before it, from one plain
    forward of the model (the first token: None)."""
    logits = lm.model(torch.tensor([ids], device=lm.device)).logits[0]
    entries = [TokenLogprob(ids[0], None)]
    entries += [of_logits(logits[i - 1], ids[i], top) for i in range(1, len(ids))]
    return entries


def completion_logprobs(lm, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """The completions API's `logprobs` object: tokens, token_logprobs, top_logprobs (a map
    token -> log-probability per place) and text_offset (where each token's text starts,
    counting from `offset`)."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(lm.decode([entry.token_id]))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else _by_text(lm, e.top) for e in entries],
            "text_offset": offsets}


def _by_text(lm, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """{token text: log-probability}, most likely first; two ids of one text (byte pieces that
    decode alike) keep the likelier's."""
    found: dict[str, float] = {}
    for token_id, logprob in top:
        found.setdefault(lm.decode([token_id]), logprob)
    return found


def chat_logprobs(lm, entries: list[TokenLogprob]) -> dict:
    """The chat API's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def token(token_id: int, logprob: float) -> dict:
        text = lm.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(i, p) for i, p in e.top]}
                        for e in entries]}

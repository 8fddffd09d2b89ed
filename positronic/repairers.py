"""Repairers (Steps 3c–3d): propose fewer, better tokens for a dim adjacent pair.

- `self`: the model's own greedy prediction for the pair's slot given the left context. The
  left context is already in the cache, so a proposal costs one forward of the token just
  left of the pair (over the rows before it), plus one per extra proposed token.
- `mlm:PATH`: a masked LM from a local directory fills one mask in place of the pair. Text
  crosses between the two vocabularies as whole spans, never token by token.
- `none`: proposes nothing, so dim pairs are deleted when the budget needs it and left
  alone otherwise: brightness culling without repair.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .forward import forward


class RepairerError(ValueError):
    """A repairer specification that cannot be used."""


class SelfRepairer:
    """Greedy proposals from the brain's own model; `tokens` = how many to propose per pair."""

    def __init__(self, state, tokens: int = 1):
        if tokens < 1:
            raise RepairerError(f"the self repairer proposes at least 1 token, not {tokens}")
        self.state, self.tokens = state, tokens
        self.refused = {i for i in (state.lm.bos_id, state.lm.eos_id) if i is not None}

    def propose(self, context_ids: list[int], pair: tuple[int, int]) -> list[int]:
        row = pair[0] - 1  # the token whose prediction fills the slot
        if row < 0:
            return []
        sm = self.state
        position = sm.mirror.live.positions[row]
        cache = sm.store.left_context(row)
        result = forward(sm.lm, cache, [context_ids[row]], [position])
        proposal: list[int] = []
        for k in range(self.tokens):
            token_id = int(result.logits.argmax())
            if token_id in self.refused:
                break
            proposal.append(token_id)
            if k + 1 < self.tokens:
                result = forward(sm.lm, cache, [token_id], [position + 1 + k])
        return proposal


class NoRepairer:
    """Cull only: never proposes a replacement."""

    def propose(self, context_ids: list[int], pair: tuple[int, int]) -> list[int]:
        return []


class MaskedLMRepairer:
    """Fill one mask between the pair's neighbours with a local masked LM."""

    def __init__(self, lm, path: str, *, window: int = 32, max_tokens: int = 3):
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForMaskedLM.from_pretrained(path, local_files_only=True).eval()
        except Exception as exc:  # transformers raises many kinds for a bad directory
            raise RepairerError(f"cannot load a masked LM from {path!r}: {str(exc).splitlines()[0]}") from None
        if self.tokenizer.mask_token is None:
            raise RepairerError(f"the tokenizer in {path!r} has no mask token")
        self.lm, self.window, self.max_tokens = lm, window, max_tokens

    @torch.inference_mode()
    def propose(self, context_ids: list[int], pair: tuple[int, int]) -> list[int]:
        p1, p2 = pair
        decode = self.lm.decode
        left = decode(context_ids[max(0, p1 - self.window) : p1])
        original = decode(context_ids[max(0, p1 - self.window) : p2 + 1])[len(left):]
        right = decode(context_ids[max(0, p1 - self.window) : p2 + 1 + self.window])[len(left) + len(original):]
        space = " " if original[:1].isspace() else ""
        text = f"{left}{space}{self.tokenizer.mask_token}{right}"
        encoded = self.tokenizer(text, return_tensors="pt", truncation=True)
        where = (encoded.input_ids[0] == self.tokenizer.mask_token_id).nonzero()
        if len(where) != 1:
            return []
        logits = self.model(**encoded).logits[0, where[0, 0]]
        for candidate in logits.topk(5).indices.tolist():
            if candidate in self.tokenizer.all_special_ids:
                continue
            word = self.tokenizer.decode([candidate]).strip().removeprefix("##")
            if word:
                return self.lm.encode(space + word)[: self.max_tokens]
        return []


def check_spec(spec: str) -> None:
    """RepairerError unless `spec` names a repairer: `self`, `none`, or `mlm:PATH` with PATH
    an existing directory (whether it holds a masked LM is only known when it is loaded).
    Cheap, so settings are checked before any model is loaded."""
    if spec in ("self", "none"):
        return
    if not spec.startswith("mlm:"):
        raise RepairerError(f"unknown repairer {spec!r}; use 'self', 'mlm:PATH' or 'none'")
    path = spec.removeprefix("mlm:")
    if not Path(path).is_dir():
        raise RepairerError(f"masked LM directory {path!r} does not exist (use mlm:PATH with a local model)")


def make_repairer(spec: str, state, *, tokens: int = 1):
    """`self`, `mlm:PATH` or `none`."""
    check_spec(spec)
    if spec == "self":
        return SelfRepairer(state, tokens)
    if spec == "none":
        return NoRepairer()
    return MaskedLMRepairer(state.lm, spec.removeprefix("mlm:"), max_tokens=max(tokens, 1))

"""Repairers (Steps 3c–3d): propose fewer, better tokens for a dim adjacent pair.

- `bridge`: compresses. Candidates for a pair (a, b) are the pair's own tokens and the
  model's greedy prediction for the slot; each is scored by how well it bridges to the text
  on the right: log P(r | left context, candidate), r the token right of the pair. The
  scores come from probes (forward.Probes) that ride along in a tick's single forward: when
  the policy repairs a batch, the repairer asks for probes of the pairs next in line, and
  repairs them with the best candidate at the next batch (a pair it has no scores for is
  culled). No forward of its own.
- `self`: the model's own greedy prediction for the pair's slot given the left context: the
  token the model predicted after the row just left of the pair when that row was written
  (`ContextView.predicted`, kept for every row by the forward that wrote it). A proposal
  costs no forward at all, so the tick keeps its single forward.
- `mlm:PATH`: a masked LM from a local directory fills one mask in place of the pair. Text
  crosses between the two vocabularies as whole spans, never token by token.
- `none`: proposes nothing, so dim pairs are deleted when the budget needs it and left
  alone otherwise: brightness culling without repair.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..state.forward import Probes
from ..util import is_int_list


class RepairerError(ValueError):
    """A repairer specification that cannot be used."""


class SelfRepairer:
    """The model's greedy prediction for the pair's slot: one token per pair."""

    def __init__(self, lm, tokens: int = 1):
        if tokens != 1:
            raise RepairerError(f"the self repairer proposes exactly 1 token (the model's prediction for the slot), "
                                f"not {tokens}; use --repairer mlm:PATH for longer proposals")
        self.refused = {i for i in (lm.bos_id, lm.eos_id) if i is not None}

    def propose(self, view, pair: tuple[int, int]) -> list[int]:
        row = pair[0] - 1  # the token whose prediction fills the slot
        if row < 0:
            return []
        token_id = int(view.predicted[row])
        return [] if token_id in self.refused else [token_id]


class BridgeRepairer:
    """Keep the candidate that best bridges the pair's left context to its right neighbour.

    Candidates of a pair (p1, p2): token[p1], token[p2] and the model's greedy prediction
    after row p1 - 1 (BOS/EOS never), each scored log P(r | left, candidate); and culling
    the pair, scored log P(r | left): the row left of the pair probed in its own place. A
    candidate must beat culling by `margin` nats to be proposed (a repair frees one row
    where a cull frees two, so it has to earn its place). `request(view, pairs)` returns the
    probes and what they ask; `adopt(asked, logprobs)` takes their log-probabilities once
    the tick that ran them went through; `propose(view, pair)` returns
    the best candidate of a scored pair, or nothing (cull). Scores are keyed by the ledger
    ids of the pair and its right neighbour, so they follow the rows through splices and are
    dropped if any of the three is gone.
    """

    CULL = -1  # the candidate "no token": the pair is culled

    def __init__(self, lm, tokens: int = 1, *, margin: float = 0.0):
        if tokens != 1:
            raise RepairerError(f"the bridge repairer proposes exactly 1 token per pair, not {tokens}")
        self.margin = margin
        self.refused = {i for i in (lm.bos_id, lm.eos_id) if i is not None}
        self.scores: dict[tuple[int, int, int], dict[int, float]] = {}

    def _key(self, view, pair: tuple[int, ...]) -> tuple[int, int, int] | None:
        p1, p2 = pair[0], pair[-1]
        if p2 + 1 >= len(view) or p1 < 1:
            return None
        ids = view.ledger_ids
        return int(ids[p1]), int(ids[p2]), int(ids[p2 + 1])

    def request(self, view, pairs) -> tuple[Probes | None, list[tuple[tuple[int, int, int], int]]]:
        """The probes for `pairs` and, per probe, the (key, candidate) it scores."""
        tokens, positions, targets, asked = [], [], [], []
        for pair in pairs:
            key = self._key(view, pair)
            if key is None:
                continue
            p1, p2 = pair[0], pair[-1]
            candidates = dict.fromkeys(int(t) for t in (view.token_ids[p1], view.token_ids[p2], view.predicted[p1 - 1]))
            target = int(view.token_ids[p2 + 1])
            for candidate in candidates:
                if candidate in self.refused:
                    continue
                tokens.append(candidate)
                positions.append(int(view.positions[p1]))
                targets.append(target)
                asked.append((key, candidate))
            tokens.append(int(view.token_ids[p1 - 1]))  # the cull: what the left row predicts without the pair
            positions.append(int(view.positions[p1 - 1]))
            targets.append(target)
            asked.append((key, self.CULL))
        return (Probes(tuple(tokens), tuple(positions), tuple(targets)) if tokens else None), asked

    def adopt(self, asked: list[tuple[tuple[int, int, int], int]], logprobs: list[float] | None) -> None:
        """The log-probabilities of the probes `asked` (None: nothing was scored, the scores stay)."""
        if logprobs is None:
            return
        scores: dict[tuple[int, int, int], dict[int, float]] = {}
        for (key, candidate), logprob in zip(asked, logprobs):
            scores.setdefault(key, {})[candidate] = logprob
        self.scores = scores

    def state(self) -> dict:
        """The scores of the last probes (they drive the next batch's choices), as plain data."""
        return {"scores": [[*key, candidate, logprob] for key, scored in self.scores.items()
                           for candidate, logprob in scored.items()]}

    def load_state(self, state: dict) -> None:
        rows = state.get("scores") if isinstance(state, dict) and set(state) == {"scores"} else None
        if not isinstance(rows, list) or not all(
                isinstance(r, list) and len(r) == 5 and is_int_list(r[:4]) and type(r[4]) in (int, float)
                for r in rows):
            raise ValueError("bridge repairer: malformed saved state")
        scores: dict[tuple[int, int, int], dict[int, float]] = {}
        for a, b, c, candidate, logprob in rows:
            scores.setdefault((a, b, c), {})[candidate] = logprob
        self.scores = scores

    def propose(self, view, pair: tuple[int, int]) -> list[int]:
        scored = self.scores.get(self._key(view, pair))
        if not scored or self.CULL not in scored:
            return []
        best = max((c for c in scored if c != self.CULL), key=scored.get, default=None)
        if best is None or scored[best] < scored[self.CULL] + self.margin:
            return []
        return [best]


class NoRepairer:
    """Cull only: never proposes a replacement."""

    def propose(self, view, pair: tuple[int, int]) -> list[int]:
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
    def propose(self, view, pair: tuple[int, int]) -> list[int]:
        p1, p2 = pair
        context_ids = view.token_ids.tolist()
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
    if spec in ("self", "bridge", "none"):
        return
    if not spec.startswith("mlm:"):
        raise RepairerError(f"unknown repairer {spec!r}; use 'bridge', 'self', 'mlm:PATH' or 'none'")
    path = spec.removeprefix("mlm:")
    if not Path(path).is_dir():
        raise RepairerError(f"masked LM directory {path!r} does not exist (use mlm:PATH with a local model)")


def make_repairer(spec: str, lm, *, tokens: int = 1, margin: float = 0.0):
    """`bridge`, `self`, `mlm:PATH` or `none`, for a run of `lm`."""
    check_spec(spec)
    if spec == "self":
        return SelfRepairer(lm, tokens)
    if spec == "bridge":
        return BridgeRepairer(lm, tokens, margin=margin)
    if spec == "none":
        return NoRepairer()
    return MaskedLMRepairer(lm, spec.removeprefix("mlm:"), max_tokens=max(tokens, 1))

"""The retrieval probe: a fact early in a stream of filler text, a question at its end, and
how well each bounded cache still answers it (the answer teacher-forced, its NLL and ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..brain.loop import BrainConfig
from .stream import EvalError, StreamResult, run_stream

PROBE_FACT = "The secret code is 4817. Remember this code.\n\n"
PROBE_QUESTION = "\n\nQuestion: what is the secret code? Answer: The secret code is "
PROBE_ANSWER = "4817"  # the space before it belongs to the question: only the digits are scored


@dataclass
class ProbeResult:
    logprob: float  # sum of the answer tokens' log-probabilities (natural log)
    ranks: list[int]  # rank of each answer token (1 = most likely)
    filler: int  # filler tokens in the stream (before and after the fact)
    logprobs: list[float] = field(default_factory=list)  # per answer token
    recalled: bool = False  # every answer token ranked first
    fact_at: int = 1  # stream index of the fact's first token (its row until something is evicted)
    nll: float = 0.0  # the answer's NLL in nats: -logprob
    full_nll: float | None = None  # the full cache's answer NLL on the same stream
    delta: float | None = None  # nll - full_nll ("Δ nats vs full")

    def __post_init__(self):
        self.recalled = bool(self.ranks) and all(r == 1 for r in self.ranks)
        self.nll = -self.logprob

    def compare(self, full: ProbeResult | None) -> None:
        """Record the full cache's answer NLL and the difference to it."""
        if full is not None:
            self.full_nll, self.delta = full.nll, self.nll - full.nll



@dataclass
class ProbeStream:
    ids: list[int]  # BOS, filler[:k], fact, filler[k:], question, answer
    fact_at: int  # stream index of the fact's first token
    fact_end: int  # one past its last
    answer_at: int  # stream index of the first answer token
    filler: int


def probe_stream(lm, text_ids: list[int], filler: int, at: float = 0.0, keep: int = 1) -> ProbeStream:
    """BOS + the first k of `filler` text tokens + fact + the rest + question + answer, with
    k = round(at * filler) raised so that the fact starts at stream index `keep` or later
    (keep = max(sinks, protect): rows no policy evicts). The answer's tokens are those the
    tokenizer gives the question and answer together. EvalError, before anything runs, for a
    filler that is negative, longer than the text or too short to clear `keep`, and for a
    stream longer than the model's positions."""
    if not 0.0 <= at <= 1.0:
        raise EvalError(f"--probe-at must be a fraction in 0..1, got {at}")
    if filler < 0:
        raise EvalError(f"--probe-filler must be >= 0, got {filler}")
    if filler > len(text_ids):
        raise EvalError(f"--probe-filler {filler} is longer than the text ({len(text_ids)} tokens): "
                        "give a longer --text or a smaller --probe-filler")
    before = max(round(at * filler), keep - 1)
    if before > filler:
        raise EvalError(f"the probe's fact would land in the first {keep} rows, which are never evicted "
                        f"(sinks/protect): --probe-filler must be at least {keep - 1}, got {filler}")
    fact = lm.encode(PROBE_FACT)
    question, joint = lm.encode(PROBE_QUESTION), lm.encode(PROBE_QUESTION + PROBE_ANSWER)
    answer = joint[len(question):] if joint[:len(question)] == question else lm.encode(PROBE_ANSWER)
    fixed = 1 + len(fact) + len(question) + len(answer)
    if fixed + filler > lm.max_positions:
        raise EvalError(f"the probe stream ({fixed + filler} tokens: {filler} of filler + {fixed} of BOS, fact, "
                        f"question and answer) is above {lm.name}'s {lm.max_positions} positions: "
                        f"--probe-filler can be at most {lm.max_positions - fixed}")
    head = [lm.bos_id] + text_ids[:before] + fact + text_ids[before:filler] + question
    return ProbeStream(head + answer, 1 + before, 1 + before + len(fact), len(head), filler)


def run_probe(lm, probe: ProbeStream, config: BrainConfig, *, on_token=None) -> tuple[ProbeResult | None, StreamResult]:
    """Teacher-force the probe stream through `config`: its ProbeResult (None when the run
    stopped before the answer, `none` with at_capacity stop) and the StreamResult."""
    result = run_stream(lm, probe.ids, config, rank_from=probe.answer_at, on_token=on_token)
    if result.stopped_at is not None:
        return None, result
    answer = result.nll[probe.answer_at - 1:]
    return ProbeResult(-sum(answer), result.ranks, probe.filler, [-x for x in answer], fact_at=probe.fact_at), result


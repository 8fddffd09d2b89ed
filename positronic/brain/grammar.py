"""Constrained decoding: a grammar the generated text must match, as a mask on the logits.

    grammar = Grammar.json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
    brain.constraint = grammar.constraint(lm)      # every drawn token from now on keeps to it
    ...                                            # brain.step() / a Batch / the server's rounds
    brain.constraint.done                          # the grammar is complete: nothing but the end may follow

The grammars are llguidance's (a Rust library with no Python dependencies; the server's extra
installs it): a JSON schema (OpenAI's `response_format`), any JSON object (`json_object`),
llama.cpp's GBNF (llama-server's `grammar`, llama-cli's `--grammar`), Lark, or a regular
expression. llguidance was chosen over xgrammar by measurement on the embedded model's 49,152-token
vocabulary (bench/results/grammar.md): a schema compiled in 1.4 ms against 8.5 ms, a mask in
0.03 ms against 0.004 ms (both under 0.1% of a tick here), and no dependencies (xgrammar brings
triton and a runtime of its own).

A constraint only shapes draws: the mask sets every token the grammar cannot take next to -inf
before the penalties' and the temperature's work is looked at (`steps.sample(allowed=)`), and the
token drawn advances the grammar. Tokens a caller gives (typed input, forced tokens) neither read
nor move it. The mask depends on the text so far only, so a sequence in a batch gets the mask it
gets alone: constrained tokens are exact when batched as unconstrained ones are.

JSON comes out with fixed separators (", " and ": ", as Python's json.dumps writes it) and no other
whitespace: with whitespace free, a small model can spend its whole reply on newlines between
two keys.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass

import torch

EXTRA = "pip install 'positronic-brain[serve]' (or pip install llguidance)"
MAX_GRAMMAR_CHARS = 100_000  # a request's schema or grammar, as text
LABELS = {"json_object": "JSON object format", "json_schema": "JSON schema", "gbnf": "GBNF grammar",
          "lark": "Lark grammar", "regex": "regular expression", "choice": "choice"}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be used (malformed, unsupported, too large), or a token it refuses."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer adapter)
    except ImportError:
        raise GrammarError(f"constrained output needs llguidance: {EXTRA}") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the generated text must match: llguidance's grammar text and what it was made from
    (`kind`: json_object, json_schema, gbnf, lark or regex), checked when it becomes a
    `Constraint` for a model's tokenizer."""

    text: str
    kind: str

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"}, kind="json_object")

    @classmethod
    def json_schema(cls, schema: dict | str, *, kind: str = "json_schema") -> Grammar:
        """A JSON value valid under `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            _size(schema, "the JSON schema")
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        _size(json.dumps(schema), "the JSON schema")
        llguidance = _llguidance()
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be used: {exc}") from None
        return cls(text, kind)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """llama.cpp's GBNF (its `root` rule is the whole text)."""
        _size(text, "the grammar")
        llguidance = _llguidance()
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            lark = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001  (its parser raises bare Exception for an unknown rule)
            raise GrammarError(f"the GBNF grammar cannot be read: {exc}") from None
        return cls(llguidance.LLMatcher.grammar_from_lark(lark), "gbnf")

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A Lark grammar as llguidance reads it (its `start` rule is the whole text)."""
        _size(text, "the grammar")
        return cls(_llguidance().LLMatcher.grammar_from_lark(text), "lark")

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        """Exactly one of `options` (vLLM's guided_choice)."""
        if not options or not all(isinstance(option, str) for option in options):
            raise GrammarError("a choice is a non-empty list of strings")
        _size("".join(options), "the choices")
        return cls(_llguidance().LLMatcher.grammar_from_regex("|".join(map(re.escape, options))), "choice")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that matches `pattern` whole."""
        _size(pattern, "the regular expression")
        return cls(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")

    def constraint(self, lm) -> Constraint:
        """A fresh `Constraint` of this grammar for `lm`'s tokens; GrammarError naming what is
        wrong with the grammar (nothing is generated with one that is)."""
        llguidance = _llguidance()
        tokenizer = tokens_of(lm)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.text, tokenizer)
        if failed:
            raise GrammarError(f"the {LABELS[self.kind]} cannot be used: {messages[0].strip()}")
        matcher = llguidance.LLMatcher(tokenizer, self.text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {LABELS[self.kind]} cannot be used: {matcher.get_error()}")
        return Constraint(matcher, lm.vocab_size, self.kind)


def is_lark(text: str) -> bool:
    """Whether a grammar's text is Lark (a `start:` rule or llguidance's header), not GBNF."""
    return re.search(r"(?m)^\s*(%llguidance\b|start\s*:)", text) is not None


def _size(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} is {len(text):,} characters, above the limit of {MAX_GRAMMAR_CHARS:,}")


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def tokens_of(lm):
    """llguidance's view of `lm`'s vocabulary (built once per tokenizer: ~0.6 s for 49k tokens),
    with the model's end-of-sequence token as the grammar's end."""
    llguidance = _llguidance()
    with _TOKENIZERS_LOCK:
        kept = _TOKENIZERS.get(lm.tokenizer)
        if kept is None or kept[0] != (lm.vocab_size, lm.eos_id):
            try:
                made = llguidance.hf.from_tokenizer(lm.tokenizer, n_vocab=lm.vocab_size, eos_token=lm.eos_id)
            except Exception as exc:  # a tokenizer llguidance cannot read (not a fast tokenizer)
                raise GrammarError(f"constrained output cannot read {lm.name}'s tokenizer: {exc}") from None
            kept = _TOKENIZERS[lm.tokenizer] = ((lm.vocab_size, lm.eos_id), made)
        return kept[1]


class Constraint:
    """One reply's grammar as it goes: which tokens may come next (`allowed`), advanced by each
    drawn token (`advance`). `done`: the grammar is complete and can take nothing more (the
    end-of-sequence token aside); `accepting`: the text so far is a whole match."""

    def __init__(self, matcher, vocab_size: int, kind: str):
        self.matcher, self.vocab_size, self.kind = matcher, vocab_size, kind
        self.tokens = 0  # advanced by
        self._allowed: torch.Tensor | None = None  # the mask for the next token, until it is taken

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar takes next. GrammarError when it takes none (its
        earlier tokens led nowhere: a grammar that cannot end)."""
        if self._allowed is None:
            bias = self.matcher.compute_logit_bias()  # a byte per token: 0 refused, 200 allowed
            mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: self.vocab_size] != 0
            if mask.shape[0] < self.vocab_size:  # the model's rows past the tokenizer's words
                mask = torch.cat([mask, mask.new_zeros(self.vocab_size - mask.shape[0])])
            if not bool(mask.any()):
                raise GrammarError(f"the {LABELS[self.kind]} allows no token after {self.tokens} tokens"
                                   + (f": {self.matcher.get_error()}" if self.matcher.is_error() else ""))
            self._allowed = mask
        return self._allowed

    def advance(self, token_id: int) -> None:
        """The drawn token `token_id` is the text's next; GrammarError if the grammar refuses it
        (it was not among `allowed()`); the constraint is then unusable."""
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} does not keep to the {LABELS[self.kind]} after "
                               f"{self.tokens} tokens: {self.matcher.get_error()}")
        self.tokens += 1
        self._allowed = None

    def copy(self) -> Constraint:
        """An independent constraint at the same point (a retried reply's, a sequence's twin)."""
        twin = Constraint(self.matcher.deep_copy(), self.vocab_size, self.kind)
        twin.tokens = self.tokens
        return twin

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

"""Constrained decoding (brain/grammar.py): every drawn token keeps to the grammar, alone, in a
Batch on the engine and ticking beside others, with the same tokens each way."""

import json

import pytest
import torch

from positronic.brain.grammar import Grammar, GrammarError
from positronic.brain.loop import Brain, BrainConfig

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPTS = [[1] + list(range(40, 70)), [1] + list(range(200, 236)), [1] + list(range(90, 115))]


def constrained(lm, prompt, grammar, ticks, **config):
    brain = Brain.start(lm, prompt, BrainConfig(**config))
    brain.constraint = grammar.constraint(lm)
    tokens = []
    while len(tokens) < ticks and not brain.constraint.done:
        tokens.append(brain.step().token_id)
    return brain, tokens


def text_of(lm, tokens):
    return lm.decode([t for t in tokens if t != lm.eos_id])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_random_model_writes_json_its_schema_accepts(tiny, temperature):
    """A random model left alone writes nothing like JSON; held to the schema it writes an
    object with exactly the required keys, of the right types, then ends."""
    for prompt in PROMPTS:
        brain, tokens = constrained(tiny, prompt, Grammar.json_schema(SCHEMA), 200, policy="streaming", budget=48,
                                    temperature=temperature, seed=3)
        assert brain.constraint.done and brain.constraint.accepting
        value = json.loads(text_of(tiny, tokens))
        assert set(value) == {"name", "age", "ok"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert type(value["age"]) is int and 0 <= value["age"] <= 150 and type(value["ok"]) is bool


def test_gbnf_and_regex_hold_and_end(tiny):
    brain, tokens = constrained(tiny, PROMPTS[0], Grammar.gbnf('root ::= ("yes" | "no") " " [0-9]{2}'), 50,
                                temperature=1.0, seed=5)
    text = text_of(tiny, tokens)
    assert brain.constraint.done and text.split(" ")[0] in ("yes", "no") and text[-2:].isdigit(), text
    brain, tokens = constrained(tiny, PROMPTS[1], Grammar.regex(r"[a-c]{3}-[0-9]{4}"), 50, temperature=1.0)
    text = text_of(tiny, tokens)
    assert len(text) == 8 and set(text[:3]) <= set("abc") and text[4:].isdigit(), text


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "brains"])
def test_constrained_brains_in_a_batch_make_their_alone_tokens(tiny, engine):
    """Greedy and seeded sampling, a shared-row press past its budget: each constrained
    sequence's tokens in a Batch (engine rounds, or ticks sharing one forward) are its tokens alone,
    and an unconstrained one beside them is not disturbed."""
    from positronic.batch import Batch

    configs = [dict(policy="streaming", budget=40, temperature=0.0), dict(policy="h2o", budget=40, temperature=0.8,
                                                                          seed=11),
               dict(policy="streaming", budget=40, temperature=0.0)]
    grammars = [Grammar.json_schema(SCHEMA), Grammar.json_object(), None]
    ticks = 30
    expected = []
    for prompt, config, grammar in zip(PROMPTS, configs, grammars):
        brain = Brain.start(tiny, prompt, BrainConfig(**config))
        brain.constraint = grammar.constraint(tiny) if grammar else None
        expected.append([brain.step().token_id for _ in range(ticks)
                         if brain.constraint is None or not brain.constraint.done])
    batch = Batch(engine=engine)
    for name, (prompt, config, grammar) in enumerate(zip(PROMPTS, configs, grammars)):
        brain = Brain.start(tiny, prompt, BrainConfig(**config))
        brain.constraint = grammar.constraint(tiny) if grammar else None
        batch.join(name, brain)
    got = [[] for _ in PROMPTS]
    for _ in range(ticks):
        for name, record in batch.step().items():
            assert not isinstance(record, Exception), record
            got[name].append(record.token_id)
    if engine:
        assert batch.seated  # the rounds ran on the engine
    for name, brain in batch.brains.items():
        if brain.constraint is not None:
            done_at = len(expected[name])
            assert got[name][:done_at] == expected[name]
            assert brain.constraint.done or done_at == ticks
        else:
            assert got[name] == expected[name]


def test_given_tokens_do_not_move_the_grammar(tiny):
    """Typed input and forced tokens go in unconstrained (they are not drawn)."""
    brain = Brain.start(tiny, PROMPTS[0], BrainConfig(temperature=0.0))
    brain.constraint = Grammar.regex("[0-9]+").constraint(tiny)
    brain.step(force=7)
    assert brain.constraint.tokens == 0
    record = brain.step()
    assert brain.constraint.tokens == 1 and tiny.decode([record.token_id]).isdigit()


def test_bad_grammars_are_refused_by_name(tiny):
    cases = [(lambda: Grammar.gbnf("root ::= missing"), "GBNF grammar cannot be read: Rule 'missing' not found"),
             (lambda: Grammar.json_schema({"type": "frob"}).constraint(tiny), "JSON schema cannot be used"),
             (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
             (lambda: Grammar.json_schema([1, 2]), "a JSON schema is an object"),
             (lambda: Grammar.regex("a(").constraint(tiny), "regular expression cannot be used"),
             (lambda: Grammar.lark("start: x" + " " * 100_001), "above the limit")]
    for make, message in cases:
        with pytest.raises(GrammarError, match=message):
            make()


def test_a_mask_is_the_grammar_s_next_tokens_and_sampling_honours_it(tiny):
    from positronic.steps.sample import sample

    constraint = Grammar.regex("7[0-9]").constraint(tiny)
    allowed = constraint.allowed()
    assert allowed.dtype == torch.bool and allowed.shape == (tiny.vocab_size,)
    ids = allowed.nonzero().flatten().tolist()
    assert ids and all(tiny.decode([i]).startswith("7") for i in ids)
    logits = torch.randn(tiny.vocab_size)
    for seed in range(20):
        token = sample(logits, temperature=2.0, allowed=allowed, generator=torch.Generator().manual_seed(seed)).token_id
        assert token in ids
    with pytest.raises(ValueError, match="allowed must be"):
        sample(logits, allowed=torch.zeros(tiny.vocab_size, dtype=torch.bool))

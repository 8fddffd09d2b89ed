"""Grammar libraries for structured output, measured on a model's vocabulary; and what a grammar
costs a tick.

    python bench/grammar.py [--model smollm2] [--repeats 5] [--ticks 40] [--json bench/results/grammar.json]

For each library installed (llguidance, the one the project uses; xgrammar, if
`pip install xgrammar` put it here) it prints, on the model's tokenizer:
  tokenizer   seconds to read the vocabulary once (kept per process)
  compile     ms to make a matcher from each of three JSON schemas (median over --repeats)
  mask        ms per token to compute the next-token mask while a valid document's tokens are
              taken one by one (median and the largest, over every token of every repeat)
Then, with the project's grammar (positronic/brain/grammar.py), ms per tick of a greedy Brain
on the model held to a JSON schema against the same Brain free (the ticks in turn, medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                      "population": {"type": "integer", "minimum": 0},
                                      "coast": {"type": "boolean"}}, "required": ["city", "population"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                 "label": {"enum": ["red", "green", "blue"]}},
                                "required": ["id", "label"]}, "maxItems": 8},
]
DOCUMENTS = [{"name": "Alice Liddell", "age": 7, "tags": ["curious", "rabbit hole", "tea party"]},
             {"city": "Oxford", "population": 162100, "coast": False},
             [{"id": 1, "label": "red"}, {"id": 2, "label": "blue"}]]


def llguidance_run(lm, repeats: int) -> dict:
    import llguidance
    import llguidance.hf

    from positronic.brain.grammar import JSON_OPTIONS
    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(lm.tokenizer, n_vocab=lm.vocab_size, eos_token=lm.eos_id)
    setup = time.perf_counter() - start
    compile_ms, mask_ms = [], []
    for _ in range(repeats):
        for schema, document in zip(SCHEMAS, DOCUMENTS):
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS))
            compile_ms.append((time.perf_counter() - start) * 1e3)
            for token in lm.encode(json.dumps(document)):
                start = time.perf_counter()
                matcher.compute_logit_bias()
                mask_ms.append((time.perf_counter() - start) * 1e3)
                assert matcher.consume_token(token), matcher.get_error()
    return {"library": f"llguidance {version('llguidance')}",
            "tokenizer_s": setup, "compile_ms": statistics.median(compile_ms),
            "mask_ms": statistics.median(mask_ms), "mask_max_ms": max(mask_ms)}


def xgrammar_run(lm, repeats: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(lm.tokenizer, vocab_size=lm.vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, lm.vocab_size)
    compile_ms, mask_ms = [], []
    for _ in range(repeats):
        for schema, document in zip(SCHEMAS, DOCUMENTS):
            start = time.perf_counter()
            matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(", ", ": ")))  # llguidance's here too
            compile_ms.append((time.perf_counter() - start) * 1e3)
            for token in lm.encode(json.dumps(document)):
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                mask_ms.append((time.perf_counter() - start) * 1e3)
                assert matcher.accept_token(token)
    return {"library": f"xgrammar {version('xgrammar')}", "tokenizer_s": setup,
            "compile_ms": statistics.median(compile_ms), "mask_ms": statistics.median(mask_ms),
            "mask_max_ms": max(mask_ms)}


def tick_cost(lm, ticks: int) -> dict:
    """ms per tick of a greedy Brain held to SCHEMAS[1] and free, ticking in turn (fresh brains
    whenever the constrained one completes its document)."""
    from positronic.brain.grammar import Grammar
    from positronic.brain.loop import Brain, BrainConfig

    prompt = [lm.bos_id] + lm.encode("A city, as JSON:")
    config = BrainConfig(temperature=0.0, budget=256)
    grammar = Grammar.json_schema(SCHEMAS[1])

    def fresh(constrained: bool) -> Brain:
        brain = Brain.start(lm, prompt, config)
        brain.constraint = grammar.constraint(lm) if constrained else None
        return brain
    brains = {True: fresh(True), False: fresh(False)}
    times = {True: [], False: []}
    for _ in range(ticks):
        for constrained in (True, False):
            brain = brains[constrained]
            if brain.constraint is not None and brain.constraint.done:
                brain = brains[constrained] = fresh(True)
            start = time.perf_counter()
            brain.step()
            times[constrained].append((time.perf_counter() - start) * 1e3)
    return {"tick_ms_constrained": statistics.median(times[True]), "tick_ms_free": statistics.median(times[False])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ticks", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    from positronic.models import load_model
    lm = load_model(args.model)
    rows = []
    for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
        try:
            rows.append(run(lm, args.repeats))
        except ImportError:
            print(f"{name}: not installed here (pip install {name} to compare)")
    print(f"{args.model}, vocabulary {lm.vocab_size}, torch threads {torch.get_num_threads()}")
    print(f"{'library':<22}{'tokenizer s':>12}{'compile ms':>12}{'mask ms':>10}{'mask max ms':>13}")
    for row in rows:
        print(f"{row['library']:<22}{row['tokenizer_s']:>12.2f}{row['compile_ms']:>12.2f}{row['mask_ms']:>10.3f}"
              f"{row['mask_max_ms']:>13.2f}")
    if len(rows) == 2:
        print(f"mask ratio xgrammar / llguidance: {rows[1]['mask_ms'] / rows[0]['mask_ms']:.2f}")
    cost = tick_cost(lm, args.ticks)
    print(f"a greedy tick: {cost['tick_ms_constrained']:.1f} ms held to a schema, {cost['tick_ms_free']:.1f} ms free "
          f"({cost['tick_ms_constrained'] / cost['tick_ms_free']:.3f}x)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "libraries": rows, **cost}, indent=1) + "\n")


if __name__ == "__main__":
    main()

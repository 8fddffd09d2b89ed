"""Exactness of splicing per model family, measured: for each random:<family> (its real
transformers class, random weights; positronic/models/random_models.py) and any real model
named with --model, the largest errors against plain transformers after random edits.

    python bench/families.py                       # the five families, float32 on the CPU
    python bench/families.py --device cuda --dtype bfloat16 --model random:qwen3

Columns: layer 0 after 15 random tick edits against a fresh prefill (max |ΔK|, max |ΔV|);
incremental decode against one forward (max |Δlogit| / max |logit|); a rebuild against a plain
DynamicCache prefill in every layer (max |ΔK|); the attention row against eager attention
(max |Δ|); 300 maintained ticks (streaming, budget 48) and the rows re-rotated meanwhile.
Results: bench/results/families.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.models import load_model, with_cache  # noqa: E402
from positronic.state import StateManager  # noqa: E402

FAMILIES = ["random:llama3", "random:qwen2", "random:qwen3", "random:mistral", "random:phi3"]


def edits(rng: random.Random, length: int, vocab: int) -> list[dict]:
    rows, taken, actions = list(range(1, length - 1)), set(), []
    rng.shuffle(rows)
    for row in rows[: rng.randint(1, 4)]:
        if {row, row + 1} & taken:
            continue
        taken |= {row, row + 1}
        if rng.random() < 0.5:
            actions.append({"action": "replace_pair", "original_pos1": row, "original_pos2": row + 1,
                            "new_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 3))]})
        else:
            actions.append({"action": "delete", "position": row})
    return actions + [{"action": "add", "token_id": rng.randrange(3, vocab)}]


@torch.no_grad()
def plain(lm, ids, positions, eager=False):
    n = len(ids)
    mask = torch.full((n, n), torch.finfo(lm.dtype).min, device=lm.device).triu(1)[None, None]
    cache = DynamicCache()
    previous = lm.model.config._attn_implementation
    if eager:
        lm.model.set_attn_implementation("eager")
    try:
        out = lm.model(input_ids=torch.tensor([ids], device=lm.device),
                       position_ids=torch.tensor([positions], device=lm.device), attention_mask=mask,
                       output_attentions=eager, **with_cache(cache), use_cache=True)
    finally:
        lm.model.set_attn_implementation(previous)
    return cache, out


def measure(lm, vocab: int) -> dict:
    rng = random.Random(5)
    ids = [lm.bos_id] + [rng.randrange(3, vocab) for _ in range(39)]
    layers = list(range(lm.num_layers))
    sm = StateManager.from_tokens(lm, ids, score_layers=layers)
    dk = dv = 0.0
    for tick in range(1, 16):
        sm.apply(edits(rng, len(sm), vocab), tick=tick)
        cache, _ = plain(lm, sm.live_token_ids(), sm.positions())
        keys, values = sm.layer_kv(0)
        dk = max(dk, (keys - cache.layers[0].keys).abs().max().item())
        dv = max(dv, (values - cache.layers[0].values).abs().max().item())
    sm.rebuild()
    cache, out = plain(lm, sm.live_token_ids(), sm.positions(), eager=True)
    rebuild = max((sm.layer_kv(i)[0] - cache.layers[i].keys).abs().max().item() for i in layers)
    eager = torch.stack([out.attentions[i][0, :, -1] for i in layers]).float()
    row = (sm.last_attention.to(eager.device) - eager).abs().max().item()
    inc = StateManager.from_tokens(lm, ids[:1])
    logits = [inc.next_logits]
    for token in ids[1:32]:
        inc.append([token])
        logits.append(inc.next_logits)
    _, full = plain(lm, ids[:32], list(range(32)))
    full = full.logits[0].float()
    parity = ((torch.stack(logits).to(full.device) - full).abs().max() / full.abs().max()).item()
    brain = Brain.start(lm, ids[:30], BrainConfig(policy="streaming", budget=48, seed=2))
    start = time.perf_counter()
    for _ in range(300):
        assert not brain.step().rebuilt
    tick_ms = (time.perf_counter() - start) / 300 * 1e3
    brain.state.check(deep=True)
    return dict(layer0_k=dk, layer0_v=dv, parity=parity, rebuild_k=rebuild, attention=row, tick_ms=tick_ms,
                rotated=brain.state.rotated_rows, positions=lm.max_positions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="a model (repeatable; default: the five random families)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"device {args.device}, dtype {args.dtype}, torch {torch.__version__}")
    print(f"{'model':<16} {'class':<20} {'L0 |dK|':>9} {'L0 |dV|':>9} {'decode':>9} {'rebuild':>9} "
          f"{'attn row':>9} {'tick ms':>8} {'rotated':>8} {'positions':>9}")
    for name in args.model or FAMILIES:
        lm = load_model(name, device=args.device, dtype=args.dtype)
        vocab = min(lm.vocab_size, 259) if name.startswith("random:") else lm.vocab_size
        r = measure(lm, vocab)
        print(f"{name:<16} {type(lm.model).__name__:<20} {r['layer0_k']:>9.1e} {r['layer0_v']:>9.1e} "
              f"{r['parity']:>9.1e} {r['rebuild_k']:>9.1e} {r['attention']:>9.1e} {r['tick_ms']:>8.2f} "
              f"{r['rotated']:>8} {r['positions']:>9}")


if __name__ == "__main__":
    main()

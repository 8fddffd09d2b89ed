"""Decode speed: Hugging Face `generate` against the brain's loop.

    python bench/decode.py [--model random:tinyllama] [--contexts 512 2048 8192] [--ticks 32] [--repeats 3]
                           [--batches 8] [--repairers none bridge self] [--recall ROWS ...]

For each live length it prints ms per token and tokens/s for
  (a) hf-generate   `model.generate` as a user gets it: the same weights in a model object of
                    its own built the library's default way (transformers' "sdpa" attention, not
                    the brain's CPU attention hook), its default DynamicCache, greedy, prefill
                    excluded;
  (b) loop, maintenance off — sample + apply([add]) per tick (one forward, no edits);
  (c) loop, maintenance on — a full Brain tick at budget = context: brightness, the dimmest
      rows culled (`none`, the default) or pairs repaired by a repairer (the bridge's probes
      ride along in the same forward), Step 4 — still one forward; per --batches x --repairers;
with the ratio (a)/(x) (above 1: faster than generate), and for each repairer its "repair"
share: 1 - tick(none) / tick(repairer), what repairing costs over culling the same batch;
  (d) with --recall ROWS: (c) culling with recall on and ROWS evicted rows in its index; "extra"
      is 1 - tick(c) / tick(d), everything recall adds (its own steps, every layer's query and
      log-normaliser in the forward, restores), "recall" the share of its own steps (scoring
      the index, copying evicted rows' K/V). The runs go in turn, `--repeats`
rounds, and every figure is the median over rounds of each round's median tick, so slow
drift of a noisy machine hits all three alike. For (c) two shares of the tick:
  apply     all of Step 4 `apply()`, including its one model forward;
  step4     `apply()` minus that forward: validation, the layout, row moves, re-rotation, the
            mirror — the maintenance machinery itself, which should stay under 5% of a tick.
and the memory of (c)'s SpliceCache (buffers with their slack, plus the shared scratch)
against the bytes of the live K/V rows alone: there is no second full-size buffer.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import steps  # noqa: E402
from positronic import StateManager, load_model  # noqa: E402
from positronic import state_manager  # noqa: E402
from positronic.loop import Brain, BrainConfig  # noqa: E402


def sync(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory_mb(lm) -> float:
    if lm.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def context_ids(lm, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return [lm.bos_id] + torch.randint(3, lm.vocab_size, (length - 1,), generator=generator).tolist()


def default_model(lm):
    """The brain's weights in a model object built the way transformers builds one by default
    (its own "sdpa" attention), so that (a) is not measured on the brain's model object."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(lm.model.config)  # from_config sets the attention on the config it is given
    with torch.device("meta"):  # no random init: every tensor is copied in below
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=lm.dtype)
    model.to_empty(device=lm.device)
    with torch.no_grad():
        model.load_state_dict(lm.model.state_dict())
        for name, buffer in lm.model.named_buffers():  # the rotary frequencies are not in the state dict
            model.get_buffer(name).copy_(buffer)
    return model.eval().requires_grad_(False)


def hf_generate(lm, model, ids: list[int], ticks: int) -> float:
    """Median seconds between consecutive decode steps of `model.generate` (so prefill is
    excluded); a logits processor stamps the time at every step."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync(lm)
            stamps.append(time.perf_counter())
            return scores

    with torch.no_grad():
        model.generate(torch.tensor([ids], device=lm.device), max_new_tokens=1 + ticks, min_new_tokens=1 + ticks,
                          do_sample=False, logits_processor=LogitsProcessorList([Clock()]),
                          pad_token_id=lm.eos_id if lm.eos_id is not None else 0)
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def loop_plain(lm, ids: list[int], ticks: int) -> float:
    """Seconds per tick of sample + apply([add]): the loop with maintenance off."""
    sm = StateManager.from_tokens(lm, ids, capacity=len(ids) + ticks + 64)
    times = []
    for _ in range(ticks):
        sync(lm)
        start = time.perf_counter()
        token = steps.sample(sm.next_logits, temperature=0).token_id
        sm.apply([{"action": "add", "token_id": token}])
        sync(lm)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class ForwardClock:
    """Seconds the StateManager spends inside model forwards (synchronised on CUDA), by
    wrapping the two forward entry points it imports, for the duration of a `with`."""

    def __init__(self, lm):
        self.lm, self.seconds = lm, 0.0

    def _timed(self, fn):
        def timed(*args, **kwargs):
            sync(self.lm)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            sync(self.lm)
            self.seconds += time.perf_counter() - start
            return result
        return timed

    def __enter__(self):
        self.saved = state_manager.forward, state_manager.prefill
        state_manager.forward, state_manager.prefill = map(self._timed, self.saved)
        return self

    def __exit__(self, *exc):
        state_manager.forward, state_manager.prefill = self.saved


def loop_maintained(lm, ids: list[int], ticks: int, batch: int = 1, repairer: str = "none",
                    recall_rows: int = 0) -> tuple[float, float, float, float, float, float]:
    """Seconds per full Brain tick at budget = context, the shares of it taken by `apply()`,
    by `apply()` without its model forward and by recall's own steps, and the cache's MiB
    against the live rows'. `recall_rows`: with recall on, its index holding that many
    evicted rows (a longer prompt, pruned to the budget at the start, fills it)."""
    budget = len(ids)
    if recall_rows:
        ids = ids + context_ids(lm, recall_rows + 1)[1:]
    brain = Brain.start(lm, ids, BrainConfig(budget=budget, temperature=0, window=32, repair_batch=batch,
                                             repairer=repairer, recall=bool(recall_rows)))
    times, apply_shares, step4_shares, recall_shares = [], [], [], []
    with ForwardClock(lm) as clock:
        for _ in range(ticks):
            sync(lm)
            clock.seconds = 0.0
            start = time.perf_counter()
            record = brain.step()
            sync(lm)
            times.append(time.perf_counter() - start)
            apply_shares.append(record.seconds["apply"] / times[-1])
            step4_shares.append((record.seconds["apply"] - clock.seconds) / times[-1])
            recall_shares.append(record.seconds.get("recall", 0.0) / times[-1])
    cache = brain.state.cache
    live = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    # a batch works on one tick in `batch`: what it costs is the mean tick, not the median
    average = statistics.median if batch == 1 else statistics.fmean
    return (average(times), average(apply_shares), average(step4_shares),
            cache.memory_bytes() / 2**20, live / 2**20, average(recall_shares))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tinyllama")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--ticks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[8],
                        help="rows freed at once to run (c) with; --ticks should be a multiple of each")
    parser.add_argument("--repairers", nargs="+", default=["none", "bridge", "self"],
                        help="repairers to run (c) with (none = cull only, the default policy)")
    parser.add_argument("--recall", type=int, nargs="*", default=[], metavar="ROWS",
                        help="also run (d): (c) with culling and recall on, its index holding ROWS evicted rows "
                             "(each given size; cut to the model's positions)")
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    hf = default_model(lm)
    import transformers

    device_name = torch.cuda.get_device_name() if lm.device.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    print(f"model {lm.name}  {device_name}  {str(lm.dtype).removeprefix('torch.')}  "
          f"attention: brain {lm.model.config._attn_implementation}, hf-generate {hf.config._attn_implementation}  "
          f"torch {torch.__version__}  "
          f"transformers {transformers.__version__}  ticks {args.ticks} x {args.repeats} rounds  "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'context':>7} {'run':<36} {'ms/tok':>8} {'tok/s':>7} {'vs hf':>6} {'apply':>6} {'step4':>6} "
          f"{'extra':>6} {'recall':>6} {'cache MiB':>10} {'live KV MiB':>12} {'peak MiB':>9}")
    variants = [(b, r, 0) for b in args.batches for r in args.repairers]
    variants += [(b, "none", n) for b in args.batches for n in args.recall]
    for context in args.contexts:
        if context > lm.max_positions:
            print(f"{context:>7} skipped: beyond the model's {lm.max_positions} positions")
            continue
        ids = context_ids(lm, context)
        room = lm.max_positions - context - args.ticks - 1  # recall's evicted rows held positions too
        rounds = []
        for _ in range(args.repeats):
            base = hf_generate(lm, hf, ids, args.ticks)
            plain = loop_plain(lm, ids, args.ticks)
            maintained = [loop_maintained(lm, ids, args.ticks, batch, repairer, min(rows, room))
                          for batch, repairer, rows in variants]
            rounds.append((base, plain, *maintained))
        rows = []
        names = [f"(c) maintenance on, batch {b}, {r}" if not n else f"(d) (c) + recall, {min(n, room)} in index"
                 for b, r, n in variants]
        for k, name in enumerate(["(a) hf-generate (sdpa)", "(b) loop, maintenance off"] + names):
            seconds = statistics.median(r[k] if k < 2 else r[k][0] for r in rounds)
            ratio = statistics.median(r[0] / (r[k] if k < 2 else r[k][0]) for r in rounds)
            cells = ""
            if k >= 2:
                apply, step4, cache_mb, live_mb, recall = (statistics.median(r[k][j] for r in rounds)
                                                           for j in (1, 2, 3, 4, 5))
                batch, repairer, recalled = variants[k - 2]
                cull = variants.index((batch, "none", 0)) + 2 if (batch, "none", 0) in variants else None
                # the extra: repairing over culling, or (d) recall (its steps and every layer's query) over (c)
                extra = (f"{statistics.median(1 - r[cull][0] / r[k][0] for r in rounds):>6.1%}"
                         if cull is not None and (repairer != "none" or recalled) else f"{'':>6}")
                cells = f"{apply:>6.1%} {step4:>6.1%} {extra} {recall if recalled else 0:>6.1%} {cache_mb:>10.1f} {live_mb:>12.1f}"
            rows.append((name, seconds, ratio, cells))
        for name, seconds, vs, cells in rows:
            print(f"{context:>7} {name:<36} {seconds * 1e3:>8.2f} {1 / seconds:>7.1f} {vs:>5.2f}x "
                  f"{cells or f'{chr(32) * 51}':<51} {peak_memory_mb(lm):>9.0f}", flush=True)


if __name__ == "__main__":
    main()

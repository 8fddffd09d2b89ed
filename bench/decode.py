"""Decode speed: Hugging Face `generate` against the brain's loop.

    python bench/decode.py [--model random:tinyllama] [--contexts 512 2048 8192] [--ticks 32] [--repeats 3]
                           [--batches 8] [--repairers none bridge self] [--recall ROWS ...]
                           [--policies streaming smartkv ...] [--smartkv] [--paired TICKS]
                           [--sequences 1 8]

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
      the index, copying evicted rows' K/V);
  (e) with --policies: a maintained tick of each policy with its own defaults (smartkv: the
      gates shipped for the model, else untrained ones, which cost what trained ones do; a
      window of half the budget; smartkv+recall: the same with recall on and its index filled
      with the first --recall ROWS, default 2048), timed as the mean over whole maintenance cycles after one
      untimed cycle (a policy's eviction batch; for smartkv its window, since its gates score
      the window's tokens in one batch each time the window turns over);
  (f) with --smartkv: `model.generate` with a SmartKVCache of `context` rows, as streaming (4
      sinks + a recent window) and with gates (the layout of (e)), timed like (e).
  (g) with --paired TICKS (instead of (a)-(f)): the --policies' brains of (e) tick in turn, one
      tick each, so that their times are taken over the same stretch of time: on a shared, noisy
      machine the ratio of two policies' ticks timed minutes apart moves by ±0.1, ticking in
      turn it does not drift.
  (h) with --sequences B ...: B brains, each as (c) culling with the first --batches, and
      each as (e) for every --policies policy (the same context for the first, other random
      tokens of that length for the rest), ticking together as one `positronic.batch.Batch`
      (one model forward a round for all of them), timed as (e) is: ms per generated token (a
      round over B), and its ratio against the same brain alone. A batch of 1 ticks as a
      brain alone does; a batch of 8 shows what a token costs when 8 conversations share the
      forwards (bench/batch.py compares them ticking in turn in detail).
  (i) with --compiled: (h)'s batches (B = 1 without --sequences) as compiled Core v4 rounds
      (`Batch(compiled=True)`, which seats a lone brain too: positronic/models/compiled.py),
      timed as (h) after the same untimed cycle, in which each bucket's graph is made; against
      the same brain alone, eager: compiled against eager in the same run.
Where both ran, SmartKV against streaming is printed as a ratio: the brain's smartkv tick over
its streaming tick, and the SmartKVCache with gates over the same cache without. "choose" is
the share of a tick the policy spends choosing rows (its score + select steps; in (f) the
cache's gate scoring). The runs go in turn, `--repeats` rounds, and every figure is the median
over rounds of each round's median tick (mean where work comes in batches), so slow drift of
a noisy machine hits all of them alike. For (c) two shares of the tick:
  apply     all of Step 4 `apply()`, including its one model forward;
  step4     `apply()` minus that forward: validation, the layout, row moves, re-rotation, the
            mirror — the maintenance machinery itself, which should stay under 5% of a tick.
and the memory of (c)'s SpliceCache (buffers with their slack, plus the shared scratch)
against the bytes of the live K/V rows alone: there is no second full-size buffer.
"""

from __future__ import annotations

import argparse
import functools
import gc
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from positronic import steps  # noqa: E402
from positronic import StateManager, load_model  # noqa: E402
from positronic.state import manager as state_manager  # noqa: E402
from positronic.batch import Batch  # noqa: E402
from positronic.brain.loop import Brain, BrainConfig  # noqa: E402
from positronic.models import with_cache  # noqa: E402
from positronic.policies import POLICIES  # noqa: E402
from positronic.smartkv import GateSet, SmartKVCache  # noqa: E402
from positronic.smartkv.gates import SHIPPED, bench_gates  # noqa: E402


def sync(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory_mb(lm) -> float:
    if lm.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def context_ids(lm, length: int, sequence: int = 0) -> list[int]:
    """`length` random tokens after BOS, the same for a length and sequence number every run."""
    generator = torch.Generator().manual_seed(length + 1_000_003 * sequence)
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


def hf_generate(lm, model, ids: list[int], ticks: int, cache=None, warm: int = 0) -> tuple[float, float]:
    """Seconds between consecutive decode steps of `model.generate` (so prefill is excluded):
    the median over `ticks` steps, or with a `cache` (a SmartKVCache) the mean over the `ticks`
    steps after `warm` untimed ones, since its scoring comes in batches; a logits processor
    stamps the time at every step. Also the share of those steps spent in the cache's gate
    scoring (0 without a cache)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    scoring = ScoringClock(cache) if cache is not None and cache.gates is not None else None
    stamps: list[tuple[float, float]] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync(lm)
            stamps.append((time.perf_counter(), scoring.seconds if scoring else 0.0))
            return scores

    with torch.no_grad():
        model.generate(torch.tensor([ids], device=lm.device), max_new_tokens=1 + warm + ticks,
                       min_new_tokens=1 + warm + ticks, do_sample=False, **with_cache(cache),
                       logits_processor=LogitsProcessorList([Clock()]),
                       pad_token_id=lm.eos_id if lm.eos_id is not None else 0)
    stamps = stamps[warm:]
    if cache is None:
        return statistics.median(b[0] - a[0] for a, b in zip(stamps, stamps[1:])), 0.0
    (start, scored_before), (end, scored_after) = stamps[0], stamps[-1]
    return (end - start) / (len(stamps) - 1), (scored_after - scored_before) / (end - start)


class ScoringClock:
    """Seconds a SmartKVCache spends scoring keys (un-rotation and the gates, timed around its
    layout's scorer call)."""

    def __init__(self, cache):
        self.seconds = 0.0
        score = cache.layout.score

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return score(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        cache.layout.score = timed


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


class Timing(NamedTuple):
    """One run's figures: seconds per token (or tick), and the shares of it and the memory
    figures that apply to it (None where a run has no such part)."""

    seconds: float
    apply: float | None = None    # all of Step 4 `apply()`, its forward included
    step4: float | None = None    # `apply()` minus its forward
    recall: float | None = None   # recall's own steps
    choose: float | None = None   # the policy choosing rows: its score + select steps (a SmartKVCache: gate scoring)
    cache_mb: float | None = None
    live_mb: float | None = None


def maintenance_cycle(config: BrainConfig) -> int:
    """Ticks after which a policy's work repeats: its eviction batch, or for smartkv its window
    (the gates score the window's tokens in one batch each time the window turns over)."""
    return config.window if config.policy == "smartkv" else POLICIES[config.policy].batch(config)


def loop_maintained(lm, ids: list[int], ticks: int, batch: int = 1, repairer: str = "none",
                    recall_rows: int = 0, policy: str | None = None, gates: str = "") -> Timing:
    """A full Brain tick at budget = context: seconds, the shares of it taken by `apply()`, by
    `apply()` without its model forward, by recall's own steps and by the policy's choosing,
    and the cache's MiB against the live rows'. Without a `policy`, (c) and (d): brightness with
    a 32-row window, culling or repairing `batch` rows at once; `recall_rows`: with recall on,
    its index holding that many evicted rows (a longer prompt, pruned to the budget at the
    start, fills it). With one, (e): that policy with its own defaults (smartkv: `gates`, a file
    or "" for the shipped ones), one `maintenance_cycle` of untimed ticks first, then `ticks`
    rounded up to whole cycles."""
    gc.collect()  # the brains of the runs before (kept by their reference cycles) go first: no run pays for another's
    if policy is None:
        budget = len(ids)
        if recall_rows:
            ids = ids + context_ids(lm, recall_rows + 1)[1:]
        brain, warm = Brain.start(lm, ids, culling_config(budget, batch, repairer, recall=bool(recall_rows))), 0
    else:
        brain, warm = policy_brain(lm, ids, policy, gates, recall_rows)
        ticks = -(-ticks // warm) * warm
        for _ in range(warm):
            brain.step()
    times, apply_shares, step4_shares, recall_shares, choose_shares = [], [], [], [], []
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
            choose_shares.append((record.seconds.get("score", 0.0) + record.seconds.get("select", 0.0)) / times[-1])
    cache = brain.state.cache
    live = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    # work done once a batch or a cycle costs what the mean tick says, not the median
    average = statistics.median if batch == 1 and not warm else statistics.fmean
    return Timing(average(times), average(apply_shares), average(step4_shares), average(recall_shares),
                  average(choose_shares), cache.memory_bytes() / 2**20, live / 2**20)


def loop_batched(lm, ids: list[int], ticks: int, sequences: int, make, compiled: bool = False) -> Timing:
    """(h): `sequences` brains made by `make(ids) -> (brain, its maintenance cycle in ticks)`
    (the first on `ids`, the others on random contexts of the same length) ticking as one
    Batch, after one untimed cycle: seconds per generated token, the mean over `ticks` rounds
    rounded up to whole cycles (a policy's work comes in batches), each round `sequences` tokens.
    (i) `compiled`: every brain seated in compiled engine rounds (ValueError if one is not)."""
    gc.collect()  # the brains of the runs before (kept by their reference cycles) go first: no run pays for another's
    group, cycle = Batch(compiled=compiled), 1
    for number in range(sequences):
        brain, cycle = make(ids if not number else context_ids(lm, len(ids), number))
        group.join(number, brain)
    for _ in range(cycle):
        group.step()
    if compiled and len(group.seated) != sequences:
        brain = next(group.brains[name] for name in group.brains if name not in group.seated)
        raise ValueError(f"(i): a brain ticks alone, not in compiled rounds: {group.seats.refusal(brain)}")
    times = []
    for _ in range(-(-ticks // cycle) * cycle):
        sync(lm)
        start = time.perf_counter()
        records = group.step()
        sync(lm)
        times.append(time.perf_counter() - start)
        if failed := [record for record in records.values() if isinstance(record, Exception)]:
            raise failed[0]
    return Timing(statistics.fmean(times) / sequences)


def batch_member(lm, ids: list[int], batch: int, policy: str | None, gates: str, recall_rows: int,
                 reread: bool | None = None) -> tuple[Brain, int]:
    """A brain of (h) and its maintenance cycle: as (c) culling `batch` rows (no `policy`), or as (e)."""
    if policy is not None:
        return policy_brain(lm, ids, policy, gates, recall_rows, reread)
    return Brain.start(lm, ids, culling_config(len(ids), batch)), batch


def culling_config(budget: int, batch: int, repairer: str = "none", recall: bool = False) -> BrainConfig:
    """(c)'s brain: brightness with a 32-row window, culling (or repairing) `batch` rows at once, greedy."""
    return BrainConfig(budget=budget, temperature=0, window=32, repair_batch=batch, repairer=repairer, recall=recall)


def policy_brain(lm, ids: list[int], policy: str, gates: str, recall_rows: int,
                 reread: bool | None = None) -> tuple[Brain, int]:
    """(e)'s brain at budget len(ids): `policy` ("smartkv+recall": smartkv with recall on; +recent: its
    memory ranked by recent use too) with its
    own defaults (smartkv: `gates`, a file or "" for the shipped ones), and its maintenance
    cycle in ticks; `recall_rows`: with recall on, a longer prompt, pruned to the budget at the
    start, fills its index with that many rows; `reread`: recall's reread (None: the default, on
    with recall; compiled rounds run without it)."""
    budget = len(ids)
    if recall_rows:
        ids = ids + context_ids(lm, recall_rows + 1)[1:]
    policy, *marks = policy.split("+")
    config = BrainConfig(budget=budget, temperature=0, policy=policy, gates=gates if policy == "smartkv" else "",
                         recall=bool(recall_rows), memory_rank="recent" if "recent" in marks else "gates",
                         reread=reread if recall_rows else None)
    return Brain.start(lm, ids, config), maintenance_cycle(config)


def paired(lm, ids: list[int], policies: list[str], gates: str, index_rows: int, ticks: int) -> list[float]:
    """(g): the brains of `policies` (as (e) builds them) tick in turn, one tick each, for `ticks`
    ticks each after one untimed cycle of each: ms per tick of each, means over the same
    stretch of time, so that a noisy machine's slow drift hits them alike."""
    brains = [policy_brain(lm, ids, p, gates, index_rows if "+recall" in p else 0) for p in policies]
    for brain, cycle in brains:
        for _ in range(cycle):
            brain.step()
    seconds = [0.0] * len(brains)
    for _ in range(ticks):
        for number, (brain, _) in enumerate(brains):
            sync(lm)
            start = time.perf_counter()
            brain.step()
            sync(lm)
            seconds[number] += time.perf_counter() - start
    return [1000 * total / ticks for total in seconds]


def smartkv_cache(lm, ids: list[int], gates: GateSet | None) -> SmartKVCache:
    """A SmartKVCache of len(ids) rows as `--policy smartkv` lays them out by default (the
    brain's sinks, its default window, the rest long-term memory ranked by `gates`), or
    without gates the same cache as streaming (the sinks + a window of the rest)."""
    config, sinks = lm.model.config, BrainConfig.sinks
    if gates is None:
        return SmartKVCache.streaming(config, capacity=len(ids), sinks=sinks)
    window = POLICIES["smartkv"].default_window(len(ids))
    return SmartKVCache(config, gates, budget=len(ids) - sinks - window, sinks=sinks, window=window)


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
    parser.add_argument("--policies", nargs="*", default=[], choices=[p for p in POLICIES if p != "none"]
                        + ["smartkv+recall", "smartkv+recall+recent"], metavar="POLICY",
                        help="also run (e): a maintained tick of each policy with its own defaults "
                        f"({', '.join(p for p in POLICIES if p != 'none')}; smartkv+recall: with recall on, its "
                        "index holding the first --recall ROWS, default 2048)")
    parser.add_argument("--smartkv", action="store_true",
                        help="also run (f): generate with a SmartKVCache, as streaming (no gates) and with gates")
    parser.add_argument("--sequences", type=int, nargs="*", default=[], metavar="B",
                        help="also run (h): B brains as (c) (the first --batches), and as each --policies policy, "
                             "ticking as one batch, one forward a round; ms per generated token (e.g. --sequences 1 8)")
    parser.add_argument("--compiled", action="store_true",
                        help="add (i): (h)'s batches (B = 1 without --sequences) as compiled Core v4 rounds")
    parser.add_argument("--paired", type=int, default=0, metavar="TICKS",
                        help="instead of (a)-(f), run (g): the --policies' brains ticking in turn, one tick each, "
                             "TICKS each (rounded up to whole smartkv windows) per round, and their ratios to the "
                             "first policy, per round and as the median")
    args = parser.parse_args()
    if args.paired < 0:
        parser.error(f"--paired takes a number of ticks >= 1, got {args.paired}")
    if any(size < 1 for size in args.sequences):
        parser.error(f"--sequences takes batch sizes >= 1, got {' '.join(map(str, args.sequences))}")
    if args.paired and args.compiled:
        parser.error("--compiled adds (i) to the table of (a)-(f); --paired runs (g) instead of that table")
    if args.paired and args.sequences:
        parser.error("--sequences adds (h) to the table of (a)-(f); --paired runs (g) instead of that table")
    if args.paired and len(args.policies) < 2:
        parser.error("--paired ticks two or more --policies in turn (e.g. --policies streaming smartkv+recall)")
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    hf = default_model(lm)
    import transformers

    smart = any(p.startswith("smartkv") for p in args.policies) or args.smartkv
    shipped = lm.name in SHIPPED
    tmp = tempfile.TemporaryDirectory()
    gates, gates_file = bench_gates(lm, tmp.name) if smart else (None, "")
    device_name = torch.cuda.get_device_name() if lm.device.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    print(f"model {lm.name}  {device_name}  {str(lm.dtype).removeprefix('torch.')}  "
          f"attention: brain {lm.model.config._attn_implementation}, hf-generate {hf.config._attn_implementation}  "
          f"torch {torch.__version__}  "
          f"transformers {transformers.__version__}  ticks {args.ticks} x {args.repeats} rounds  "
          f"{time.strftime('%Y-%m-%d')}")
    if smart:
        print(f"smartkv gates: {'the shipped ones' if shipped else 'untrained (none are shipped for this model; they cost what trained ones do)'}; "
              "its runs time whole windows (one scoring batch each) after one untimed window")
    if not args.paired:
        print(f"{'context':>7} {'run':<40} {'ms/tok':>8} {'tok/s':>7} {'vs hf':>6} {'apply':>6} {'step4':>6} "
              f"{'extra':>6} {'recall':>6} {'choose':>6} {'cache MiB':>10} {'live KV MiB':>12} {'peak MiB':>9}")
    variants = [(b, r, 0) for b in args.batches for r in args.repairers]
    variants += [(b, "none", n) for b in args.batches for n in args.recall]
    with tmp:
        for context in args.contexts:
            if context + args.ticks > lm.max_positions:  # (b) grows the context by --ticks rows
                print(f"{context:>7} skipped: {context} + {args.ticks} ticks is beyond the model's "
                      f"{lm.max_positions} positions")
                continue
            ids = context_ids(lm, context)
            room = lm.max_positions - context - args.ticks - 1  # recall's evicted rows held positions too
            names = ["(a) hf-generate (sdpa)", "(b) loop, maintenance off"]
            names += [f"(c) maintenance on, batch {b}, {r}" if not n else f"(d) (c) + recall, {min(n, room)} in index"
                      for b, r, n in variants]
            window = POLICIES["smartkv"].default_window(context)  # smartkv: timed over whole windows
            cycle_ticks = window + -(-args.ticks // window) * window
            smart_fits = context + cycle_ticks + 1 <= lm.max_positions
            policies = [p for p in args.policies if not p.startswith("smartkv") or smart_fits]
            # smartkv+recall: its index filled by a longer prompt (pruned at the start), within the positions
            index_rows = min(args.recall[0] if args.recall else 2048, lm.max_positions - context - cycle_ticks - 1)
            cache_runs = args.smartkv and smart_fits
            if not smart_fits and smart:
                print(f"{context:>7} smartkv skipped: a window of warm-up and the timed windows go beyond the "
                      f"model's {lm.max_positions} positions")
            if args.paired:
                paired_rounds(lm, context, ids, policies, gates_file, index_rows,
                              -(-args.paired // window) * window, args.repeats)
                continue
            names += [f"(e) policy {p}" for p in policies]
            # (h): (label, policy, the same brain alone's row, the ratio's name)
            cull = args.batches[0]
            batched = [(f"(c) batch {cull}", None, f"(c) maintenance on, batch {cull}, none", "(c)")]
            batched += [(p, p, f"(e) policy {p}", f"policy {p}") for p in policies]
            against = [(f"(h) {size} batched, {label}", alone, f"{short} {size} batched, per token / alone")
                       for label, _, alone, short in batched for size in args.sequences]
            compiled_sizes = (args.sequences or [1]) if args.compiled else []
            against += [(f"(i) {size} compiled, {label}", alone, f"{short} {size} compiled, per token / alone eager")
                        for label, _, alone, short in batched for size in compiled_sizes]
            names += [row for row, _, _ in against]
            names += ["(f) hf-generate + SmartKVCache streaming", "(f) hf-generate + SmartKVCache gates"] \
                if cache_runs else []
            rounds = []
            for _ in range(args.repeats):
                runs = [Timing(hf_generate(lm, hf, ids, args.ticks)[0]), Timing(loop_plain(lm, ids, args.ticks))]
                runs += [loop_maintained(lm, ids, args.ticks, batch, repairer, min(rows, room))
                         for batch, repairer, rows in variants]
                runs += [loop_maintained(lm, ids, args.ticks, policy=p, gates=gates_file,
                                         recall_rows=index_rows if "+recall" in p else 0) for p in policies]
                runs += [loop_batched(lm, ids, args.ticks, size, functools.partial(
                             batch_member, lm, batch=cull, policy=p, gates=gates_file,
                             recall_rows=index_rows if p and "+recall" in p else 0))
                         for _, p, *_ in batched for size in args.sequences]
                runs += [loop_batched(lm, ids, args.ticks, size, functools.partial(
                             batch_member, lm, batch=cull, policy=p, gates=gates_file,
                             recall_rows=index_rows if p and "+recall" in p else 0, reread=False), compiled=True)
                         for _, p, *_ in batched for size in compiled_sizes]
                if cache_runs:
                    timed = cycle_ticks - window
                    for with_gates in (None, gates):
                        seconds, scoring = hf_generate(lm, hf, ids, timed, smartkv_cache(lm, ids, with_gates), warm=window)
                        runs.append(Timing(seconds, choose=scoring if with_gates else None))
                rounds.append(runs)
            print_rows(context, names, variants, rounds, peak_memory_mb(lm))
            comparisons(context, names, rounds, against)


def print_rows(context: int, names: list[str], variants: list[tuple], rounds: list[list[Timing]], peak: float) -> None:
    """One line per run: medians over rounds, the ratio against (a) and the extra of repairing
    or recall over culling the same batch."""
    for k, name in enumerate(names):
        timings = [r[k] for r in rounds]
        seconds = statistics.median(t.seconds for t in timings)
        ratio = statistics.median(r[0].seconds / r[k].seconds for r in rounds)

        def share(field: str) -> str:
            values = [getattr(t, field) for t in timings]
            return f"{'':>6}" if values[0] is None else f"{statistics.median(values):>6.1%}"

        extra = f"{'':>6}"
        if 2 <= k < 2 + len(variants):
            batch, repairer, recalled = variants[k - 2]
            if (batch, "none", 0) in variants and (repairer != "none" or recalled):
                # repairing over culling, or (d) recall (its steps and every layer's query) over (c)
                cull = variants.index((batch, "none", 0)) + 2
                extra = f"{statistics.median(1 - r[cull].seconds / r[k].seconds for r in rounds):>6.1%}"
        memory = ""
        if timings[0].cache_mb is not None:
            memory = (f"{statistics.median(t.cache_mb for t in timings):>10.1f} "
                      f"{statistics.median(t.live_mb for t in timings):>12.1f}")
        cells = f"{share('apply')} {share('step4')} {extra} {share('recall')} {share('choose')} {memory:<23}"
        print(f"{context:>7} {name:<40} {seconds * 1e3:>8.2f} {1 / seconds:>7.1f} {ratio:>5.2f}x {cells} "
              f"{peak:>9.0f}", flush=True)


def paired_rounds(lm, context: int, ids: list[int], policies: list[str], gates: str, index_rows: int, ticks: int,
                  repeats: int) -> None:
    """(g) for `repeats` rounds: each round's ms per tick and ratio to the first policy, then the medians."""
    rounds = []
    for number in range(repeats):
        rounds.append(paired(lm, ids, policies, gates, index_rows, ticks))
        print(f"{context:>7} (g) round {number + 1}, {ticks} ticks each, in turn: "
              + ", ".join(f"{p} {ms:.2f} ms" for p, ms in zip(policies, rounds[-1]))
              + "".join(f"; {p} / {policies[0]} x{ms / rounds[-1][0]:.3f}"
                        for p, ms in zip(policies[1:], rounds[-1][1:])), flush=True)
    for index, policy in enumerate(policies[1:], start=1):
        ratio = statistics.median(r[index] / r[0] for r in rounds)
        print(f"{context:>7} (g) brain --policy {policy} / --policy {policies[0]}, ticking in turn: "
              f"x{ratio:.3f} (median of {repeats} rounds)", flush=True)


def comparisons(context: int, names: list[str], rounds: list[list[Timing]],
                batched: list[tuple[str, str, str]] = ()) -> None:
    """SmartKV against streaming, where both ran: the brain's tick and the cache in generate;
    `batched`, (h): (its row, the same brain alone's row, the ratio's name), a batch's cost per
    token against alone (the median over rounds of each round's ratio)."""
    pairs = [("(e) policy smartkv", "(e) policy streaming", "brain --policy smartkv / --policy streaming"),
             ("(e) policy smartkv+recall", "(e) policy streaming", "brain --policy smartkv --recall / --policy streaming"),
             ("(e) policy smartkv+recall", "(e) policy smartkv", "brain --policy smartkv --recall / --policy smartkv"),
             ("(f) hf-generate + SmartKVCache gates", "(f) hf-generate + SmartKVCache streaming",
              "SmartKVCache with gates / streaming, in generate")]
    pairs += list(batched)
    for first, second, label in pairs:
        if first in names and second in names:
            a, b = names.index(first), names.index(second)
            ratio = statistics.median(r[a].seconds / r[b].seconds for r in rounds)
            print(f"{context:>7} {label}: x{ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()

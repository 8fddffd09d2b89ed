"""kvpress anchor: NVIDIA kvpress's own presses on the project's teacher-forced perplexity task.

    bash bench/kvpress_env.sh                                   # once: bench/.kvpress-venv
    bench/.kvpress-venv/bin/python bench/kvpress_anchor.py --threads 1
    bench/.kvpress-venv/bin/python bench/kvpress_anchor.py --texts frankenstein --presses full knorm --tokens 64
    bench/.kvpress-venv/bin/python bench/kvpress_anchor.py --per-token --presses snapkv   # rerun old runs that
                                                            # lack per-token NLLs (for bench/significance.py)

**Task** (the same as bench/smartkv.py's): BOS + --tokens tokens of a text excerpt (bench/texts.py's
rule) are teacher-forced one token per forward; the NLL of each next token is read from the
logits before it is fed. Budgets are shares of --tokens (0.125 of 1024 -> 128 rows), and every
forward attends to at most `budget` rows per layer, the newest token included.

**Compression during decoding, as kvpress does it.** Each press runs inside kvpress's own
`DecodingPress(base_press=..., compression_interval=N, target_size=T)`, entered with kvpress's
context manager (`with press(model):`) around the whole loop, as kvpress's pipeline does for its
decoding presses; every forward passes `position_ids` (the true position), as the pipeline's
`generate_answer` does, and a plain `DynamicCache`. `DecodingPress` acts in a forward hook on
each attention layer, *after* the layer has attended: the first forward (BOS alone) counts as
prefill and is left alone; from then on the layer's step counter grows by one per forward and,
once it reaches N, the base press scores the layer's rows (kvpress's ScorerPress.compress) and
keeps the T best. A forward therefore attends to at most T + N rows; T = budget - N keeps that
at the budget. N = 1 (prune after every token, attend to `budget` rows) wherever the press runs
with it; presses that score from the hidden states buffered since the last compression need
more than one of them (SnapKV asserts more than its window, ExpectedAttention drops its n_sink
first ones), so they run with the smallest N they work with (see PRESSES).

The model is the project's embedded SmolLM2-135M (the safetensors directory the project
converts into ~/.cache/positronic/smollm2-135m-instruct, or $POSITRONIC_CACHE), loaded with this
venv's transformers in float32. This file never imports `positronic` (it needs transformers 5.x
past kvpress's pin); bench/texts.py and bench/cpu_kernels.py are torch-free and imported as is.

Output: one JSON per (text, budget, press) in --out (an existing one is reused unless --force;
one run with other CPU kernels is refused, bench/cpu_kernels.py says why), with the NLL of every
scored token (`nll`, for bench/significance.py) and the CPU kernels (`kernels`), and a markdown
table (ppl and x full per text x budget) on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_kernels import describe, record, refuse_others  # noqa: E402  (torch-free at import)
from bench.texts import excerpt  # noqa: E402  (torch-free: the excerpt rule every quality table shares)

SINKS = 4


@dataclass(frozen=True)
class Text:
    label: str
    file: str  # name under --text-dir (from sampathweb/viz-read-by-punctuations, books/, but Dracula's)
    offset: int
    held_out: bool  # held out from every tuning the project did (bench/results/smartkv.md; Huckleberry
    # Finn, A Tale of Two Cities and Earnest were until 2026-11-27's recall settings were tried on them)


TEXTS = {
    "frankenstein": Text("Frankenstein", "frankenstein.txt", 60000, False),
    "moby_dick": Text("Moby Dick", "moby_dick.txt", 60000, False),
    "huckleberry_finn": Text("Huckleberry Finn", "huckleberry_finn.txt", 60000, False),
    "tale_of_two_cities": Text("Tale of Two Cities", "tale_of_two_cities.txt", 60000, False),
    "earnest": Text("Earnest", "importance_of_being_earnest.txt", 60000, False),
    "wallpaper": Text("Wallpaper", "the_yellow_wallpaper.txt", 10000, True),
    # from Lledune/DS-Project-Dracula (dracula.txt, Gutenberg #345): first used on 2026-11-27
    "dracula": Text("Dracula", "dracula.txt", 60000, True),
    # the Canterbury corpus as Brotli 1.1.0's sdist ships it (tests/testdata; `pip download --no-deps
    # --no-binary :all: brotli==1.1.0`), from character 10,000 on (text[10000:]) in *_10k.txt: the texts of the
    # long (8,192-token) runs, which no default was tuned on (first used 2026-12-03)
    "lcet10": Text("lcet10", "lcet10_10k.txt", 0, True),
    "asyoulik": Text("As You Like It", "asyoulik_10k.txt", 0, True),
}
LONG_TEXTS = ("lcet10", "asyoulik")


@dataclass(frozen=True)
class PressSpec:
    """How one kvpress press runs in decoding. make(): the base press (None: the full cache);
    interval: DecodingPress's compression_interval; wrap: an outer kvpress wrapper around the
    base press (e.g. AdaKVPress), applied inside DecodingPress; attn: the attention
    implementation it needs; sinks: first tokens it never evicts (and how)."""
    make: Callable[[], object] | None
    interval: int = 1
    attn: str = "sdpa"
    sinks: str = "none (kvpress has no option for it)"
    note: str = ""
    wrap: Callable[[object], object] | None = None
    masked: bool = False  # rows stay in the cache and are masked per head (AdaKV): count unmasked ones
    decoder: str = "DecodingPress"  # the kvpress decoding press it runs in (CAMPress is one of its own)


def _kvpress():
    import kvpress
    return kvpress


def _presses() -> dict[str, PressSpec]:
    kp = _kvpress()
    from kvpress.utils import compute_n_kept

    class OrderedStreamingLLMPress(kp.StreamingLLMPress):
        """Diagnostic, not kvpress's: StreamingLLMPress whose kept rows stay in temporal order.
        kvpress's ScorerPress.compress keeps `scores.topk(n).indices` in topk's order; for
        StreamingLLM's tied scores (all 1 but the evicted 0) that order is arbitrary, so from the
        second compression on the rows at 0..3 are no longer the first tokens and the row at
        n_sink is no longer the oldest one (NVIDIA/kvpress issue #173)."""

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if self.compression_ratio == 0:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            kept = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices
            index = kept.sort(dim=-1).values.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    return {
        "full": PressSpec(None, sinks="-", note="no press: the whole cache"),
        "streaming": PressSpec(lambda: kp.StreamingLLMPress(n_sink=SINKS), sinks=f"{SINKS} (n_sink)",
                               note="evicts the oldest row after the sinks"),
        "streaming-ordered": PressSpec(lambda: OrderedStreamingLLMPress(n_sink=SINKS), sinks=f"{SINKS} (n_sink)",
                                       note="diagnostic (this script's subclass, not kvpress's): StreamingLLM "
                                       "with the kept rows left in temporal order"),
        "knorm": PressSpec(lambda: kp.KnormPress(), note="keeps the rows with the smallest key norms"),
        "tova": PressSpec(lambda: kp.TOVAPress(), note="the newest query's attention, averaged over all heads; "
                          "the newest row is always kept"),
        "snapkv": PressSpec(lambda: kp.SnapKVPress(window_size=1, kernel_size=5), interval=2,
                            note="window 1: DecodingPress hands SnapKV the hidden states buffered since the last "
                            "compression (N of them) and SnapKV asserts N > window; it rebuilds the window's "
                            "queries with the current token's RoPE only, so a window over 1 would rotate the "
                            "older queries at the wrong position; the window's rows are always kept"),
        "expected_attention": PressSpec(lambda: kp.ExpectedAttentionPress(n_sink=SINKS), interval=16,
                                        sinks=f"{SINKS} (n_sink)",
                                        note="query statistics from the buffered hidden states after dropping "
                                        "the first n_sink=4 of them, so N=16 gives 12 queries; the "
                                        "averaged RoPE uses positions from the buffer length (kvpress's code)"),
        "keydiff": PressSpec(lambda: kp.KeyDiffPress(), note="evicts the keys most similar to the mean key"),
        "observed_attention": PressSpec(lambda: kp.ObservedAttentionPress(), attn="eager",
                                        note="the newest query's attention weights (eager), averaged per kv "
                                        "group, divided by kvpress's prefill count of queries per key"),
        # further presses that run in decoding
        "random": PressSpec(lambda: kp.RandomPress(seed=0), note="uniform random scores (seed 0): a floor"),
        "cur": PressSpec(lambda: kp.CURPress(num_sinks=SINKS), sinks=f"{SINKS} (num_sinks)",
                         note="key x value leverage, local window 16"),
        "lagkv": PressSpec(lambda: kp.LagKVPress(n_sink=SINKS, lag_size=32), sinks=f"{SINKS} (n_sink)",
                           note="lag_size 32 (the default 128 needs n_sink + 256 rows before it scores "
                           "anything, i.e. it would be StreamingLLM at both budgets)"),
        "critical_expected": PressSpec(lambda: kp.CriticalKVPress(kp.ExpectedAttentionPress(n_sink=SINKS,
                                                                                            use_vnorm=False)),
                                       interval=16, sinks=f"{SINKS} (n_sink of ExpectedAttention)",
                                       note="CriticalKV over ExpectedAttention without value norms, N=16 as "
                                       "ExpectedAttention"),
        "cam_streaming": PressSpec(lambda: kp.StreamingLLMPress(n_sink=SINKS), decoder="CAMPress",
                                   sinks=f"{SINKS} (n_sink)",
                                   note="CAMPress (kvpress's own decoding press, in place of DecodingPress) over "
                                   "StreamingLLM: each evicted row's value is merged into the next 32 kept rows "
                                   "with probability from its cumulative attention (Bernoulli, torch seed 0); "
                                   "CAMPress sorts the kept indices, so the temporal order stays"),
        "adakv_expected": PressSpec(lambda: kp.ExpectedAttentionPress(n_sink=SINKS), interval=16,
                                    wrap=lambda p: kp.AdaKVPress(p), masked=True, sinks=f"{SINKS} (n_sink)",
                                    note="AdaKV head-wise budgets over ExpectedAttention: rows stay in the "
                                    "cache and are masked per kv head (kvpress's attention patch); the budget "
                                    "is on average per head, not per head"),
    }


MAIN = ("full", "streaming", "streaming-ordered", "knorm", "tova", "snapkv", "expected_attention", "keydiff", "observed_attention")
EXTRA = ("random", "cur", "lagkv", "critical_expected", "cam_streaming", "adakv_expected")
NOT_IN_DECODING = {  # kvpress 0.5.5 presses that cannot run here, and why
    "LeverageScorePress, NonCausalAttnPress, CompactorPress": "assert keys == queries: prefill only",
    "QFilterPress, KVzapPress, ExpectedAttentionStatsPress, DuoAttentionPress":
        "need weights / statistics from the Hugging Face hub for this model (none published for SmolLM2, "
        "and the hub is unreachable here)",
    "KVzipPress, FastKVzipPress, KVgradPress, RestoreKVPress, FinchPress, SimLayerKVPress, ThinKPress, "
    "ChunkPress, ChunkKVPress, EntropyGatedChunkKVPress, BlockPress, KVComposePress, LUKVPress":
        "not ScorerPresses (DecodingPress asserts ScorerPress or AdaKVPress): prefill-time methods or wrappers",
    "KeyRerotationPress, ComposedPress, PerLayerCompressionPress":
        "wrappers that are not ScorerPresses, so DecodingPress refuses them",
    "PyramidKVPress": "a SnapKV with per-layer budgets: a fixed per-layer budget in decoding is not what it "
                      "does; SnapKV's row stands for it",
    "DMSPress(decoding=True)": "evicts below a score threshold after a 128-row sliding window: the number of "
                               "rows kept is not bounded by a budget",
}


def model_dir(given: Path | None) -> Path:
    """The project's converted SmolLM2 (positronic/models/gguf.py: $POSITRONIC_CACHE or ~/.cache/positronic)."""
    if given is not None:
        return given
    root = Path(os.environ.get("POSITRONIC_CACHE") or Path.home() / ".cache" / "positronic")
    path = root / "smollm2-135m-instruct"
    if not (path / "model.safetensors").exists():
        raise SystemExit(f"{path} has no model.safetensors: run the project once (e.g. `python run.py eval "
                         "--help` is not enough; `python bench/smartkv.py --tokens 8 --budgets 0.5`) so it "
                         "converts its embedded SmolLM2, or pass --model-dir")
    return path


class Runner:
    def __init__(self, path: Path):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar per model load

        self.torch, self.path = torch, path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._auto, self._models = AutoModelForCausalLM, {}

    def model(self, attn: str):
        if attn not in self._models:
            model = self._auto.from_pretrained(self.path, dtype=self.torch.float32, attn_implementation=attn)
            self._models[attn] = model.eval().requires_grad_(False)
        return self._models[attn]

    def ids(self, text: Text, text_dir: Path, tokens: int) -> list[int]:
        body = excerpt(text_dir / text.file, text.offset)
        bos = self.tokenizer.bos_token_id
        if bos is None:
            bos = self.model("sdpa").config.bos_token_id
        ids = [bos] + list(self.tokenizer.encode(body, add_special_tokens=False))[:tokens]
        if len(ids) != tokens + 1:
            raise SystemExit(f"{text.file}: only {len(ids) - 1} tokens from offset {text.offset}")
        return ids

    def run(self, spec: PressSpec, ids: list[int], budget: int | None, label: str) -> dict:
        torch = self.torch
        from transformers import DynamicCache

        kp = _kvpress()
        model = self.model(spec.attn)
        press, target = None, None
        if spec.make is not None:
            target = budget - spec.interval
            base = spec.make()
            if spec.wrap is not None:
                base = spec.wrap(base)
            press = getattr(kp, spec.decoder)(base_press=base, compression_interval=spec.interval, target_size=target)
        torch.manual_seed(0)  # CAMPress's Bernoulli merge draws use the global generator
        cache = DynamicCache()
        layers = [layer.self_attn for layer in model.model.layers]
        losses, widest, widest_mean, rows_sum = [], 0, 0.0, 0.0
        start = time.perf_counter()
        with torch.inference_mode(), (press(model) if press is not None else _null()):
            for n in range(len(ids) - 1):
                most, mean_rows = self._rows_attended(cache, layers, spec.masked)
                widest, widest_mean, rows_sum = max(widest, most), max(widest_mean, mean_rows), rows_sum + mean_rows
                out = model(input_ids=torch.tensor([[ids[n]]]), position_ids=torch.tensor([[n]]),
                            use_cache=True, **_with_cache(model, cache))
                losses.append(float(torch.log_softmax(out.logits[0, -1].float(), -1)[ids[n + 1]].neg()))
                if (n + 1) % 256 == 0:
                    print(f"    {label}: {n + 1}/{len(ids) - 1} tokens, ppl so far "
                          f"{math.exp(sum(losses) / len(losses)):.3f}, {time.perf_counter() - start:.0f} s",
                          file=sys.stderr, flush=True)
        seconds = time.perf_counter() - start
        if budget is not None and widest_mean > budget:
            raise RuntimeError(f"{label}: attended to {widest_mean} rows, over the budget {budget}")
        mean = sum(losses) / len(losses)
        return {"ppl": math.exp(mean), "mean_nll": mean, "nll": [round(x, 6) for x in losses],
                "max_rows_attended": widest,
                "max_rows_attended_mean_over_heads": widest_mean,
                "mean_rows_attended": rows_sum / len(losses), "seconds": seconds,
                "decoder": spec.decoder if press else None, "interval": spec.interval if press else None,
                "target_size": target,
                "press": repr(press.base_press) if press else None, "attn_implementation": spec.attn,
                "sinks": spec.sinks, "note": spec.note}

    @staticmethod
    def _rows_attended(cache, layers, masked: bool) -> tuple[int, float]:
        """Rows the next forward attends to, as (the widest kv head of the widest layer, the mean over
        kv heads in the widest layer): the rows cached now plus the token being fed. The two differ
        only for masked presses (AdaKV), whose rows stay cached and are masked per kv head."""
        widest, widest_mean = 0, 0.0
        for idx, module in enumerate(layers):
            keys = getattr(cache.layers[idx], "keys", None) if idx < len(cache.layers) else None
            held = 0 if keys is None or keys.numel() == 0 else keys.shape[-2]
            most, mean = held, float(held)
            if masked and held and getattr(module, "masked_key_indices", None) is not None:
                per_head = module.masked_key_indices[1].bincount(minlength=keys.shape[1]).tolist()
                most, mean = held - min(per_head), held - sum(per_head) / len(per_head)
            widest, widest_mean = max(widest, most + 1), max(widest_mean, mean + 1)
        return widest, widest_mean


def _with_cache(model, cache) -> dict:
    """{keyword: cache} for this venv's transformers (positronic.models.with_cache's rule; the
    project is not importable here): `cache` where the forward takes it, else `past_key_values`."""
    takes = inspect.signature(type(model.model).forward).parameters
    return {"cache" if "cache" in takes else "past_key_values": cache}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_path(out: Path, text: str, tokens: int, budget: int | None, name: str) -> Path:
    return out / f"{text}_{tokens}_{'full' if budget is None else budget}_{name}.json"


def refuse_other_kernels(args, presses: list[str], kernels: dict) -> None:
    """SystemExit, before anything runs, if a run this one would reuse was made with other CPU
    kernels (bench/cpu_kernels.py): reused, it would put two kernels' numbers in one table."""
    paths = [run_path(args.out, t, args.tokens, None if share is None else round(share * args.tokens), name)
             for t in args.texts for name in presses for share in ([None] if name == "full" else args.budgets)]
    refuse_others(kernels, ((path, json.loads(path.read_text()).get("kernels")) for path in paths if path.exists()),
                  "give another --out, or --force to replace it")


def versions() -> dict:
    out = {}
    for name in ("kvpress", "transformers", "torch"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def table(results: dict, texts: list[str], budgets: list[float], presses: list[str], tokens: int) -> str:
    """Markdown: a row per press, a column per text x budget, 'ppl xratio' (x the full cache)."""
    head = ["press"] + [f"{TEXTS[t].label}{'*' if TEXTS[t].held_out else ''} {share:.1%}".replace(".0%", "%")
                        for t in texts for share in budgets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in presses:
        cells = [name]
        for t in texts:
            full = results.get((t, None, "full"))
            for share in budgets:
                key = (t, None, "full") if name == "full" else (t, round(share * tokens), name)
                r = results.get(key)
                if r is None:
                    cells.append("–")
                elif "error" in r:
                    cells.append("fails")
                elif name == "full" or full is None:
                    cells.append(f"{r['ppl']:.2f}")
                else:
                    cells.append(f"{r['ppl']:.2f} ×{r['ppl'] / full['ppl']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="presses that cannot run in decoding:\n" + "\n".join(
                                    f"  {k}: {v}" for k, v in NOT_IN_DECODING.items()))
    p.add_argument("--texts", nargs="+", default=[t for t in TEXTS if t not in LONG_TEXTS], choices=list(TEXTS),
                   help=f"texts to run (files under --text-dir; default: all but the long runs' {', '.join(LONG_TEXTS)})")
    p.add_argument("--text-dir", type=Path, default=Path("/tmp/texts"),
                   help="where the Gutenberg files are (sampathweb/viz-read-by-punctuations, books/*.txt; "
                   "dracula.txt from Lledune/DS-Project-Dracula)")
    p.add_argument("--presses", nargs="+", default=list(MAIN), choices=list(MAIN + EXTRA),
                   help=f"presses to run ('full' always runs first); default: {' '.join(MAIN)}; "
                   f"also: {' '.join(EXTRA)}")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25], help="shares of --tokens")
    p.add_argument("--tokens", type=int, default=1024, help="text tokens scored (BOS is added in front)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "eval_results" / "kvpress",
                   help="directory for one JSON per run (reused when present, unless --force)")
    p.add_argument("--force", action="store_true", help="rerun runs whose JSON already exists")
    p.add_argument("--per-token", action="store_true",
                   help="rerun runs whose JSON has no per-token NLLs (those before 2026-11-29), which "
                   "bench/significance.py needs")
    p.add_argument("--model-dir", type=Path, help="the converted SmolLM2 directory (default: the project's cache)")
    p.add_argument("--check-full", nargs="*", metavar="TEXT=PPL",
                   help="assert the full-cache ppl of TEXT rounds to PPL (2 decimals), e.g. frankenstein=26.51")
    args = p.parse_args(argv)

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = _presses()
    presses = ["full"] + [name for name in args.presses if name != "full"]
    kernels = record()
    if not args.force:
        refuse_other_kernels(args, presses, kernels)
    runner = Runner(model_dir(args.model_dir))
    info = versions()
    print(f"# kvpress {info['kvpress']}  transformers {info['transformers']}  torch {info['torch']}  "
          f"threads {torch.get_num_threads()}  kernels {describe(kernels)}  model {runner.path}",
          file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results, total_start = {}, time.perf_counter()
    for t in args.texts:
        text = TEXTS[t]
        ids = runner.ids(text, args.text_dir, args.tokens)
        for name in presses:
            for share in ([None] if name == "full" else args.budgets):
                budget = None if share is None else round(share * args.tokens)
                path = run_path(args.out, t, args.tokens, budget, name)
                label = f"{text.label} {name}" + ("" if budget is None else f" budget {budget}")
                if path.exists() and not args.force:
                    row = json.loads(path.read_text())
                    if not (args.per_token and "nll" not in row and "error" not in row):
                        results[t, budget, name] = row
                        print(f"  {label}: reused {path.name}", file=sys.stderr, flush=True)
                        continue
                claim = path.with_name(f".{path.stem}.running")  # several processes can share one --out
                try:
                    os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    print(f"  {label}: running in another process ({claim.name}), skipped", file=sys.stderr)
                    continue
                try:
                    print(f"  {label} ...", file=sys.stderr, flush=True)
                    try:
                        row = runner.run(specs[name], ids, budget, label)
                    except Exception as e:  # a press that cannot run in decoding gets a row saying why
                        row = {"error": f"{type(e).__name__}: {e}"}
                        print(f"  {label}: FAILED {row['error']}", file=sys.stderr, flush=True)
                    row.update({"text": text.file, "offset": text.offset, "tokens": args.tokens, "budget": budget,
                                "method": name, "threads": torch.get_num_threads(), **info, "kernels": kernels})
                    results[t, budget, name] = row
                    path.write_text(json.dumps(row, indent=1))
                finally:
                    claim.unlink(missing_ok=True)
                if "ppl" in row and (t, None, "full") in results:
                    full = results[t, None, "full"]["ppl"]
                    print(f"  {label}: ppl {row['ppl']:.3f} x{row['ppl'] / full:.3f}  max rows "
                          f"{row['max_rows_attended']}  {row['seconds']:.0f} s", file=sys.stderr, flush=True)
    for check in args.check_full or []:
        t, want = check.split("=")
        got = results[t, None, "full"]["ppl"]
        assert f"{got:.2f}" == want, f"{t}: full-cache ppl {got:.4f}, expected {want}"
        print(f"  check: {t} full-cache ppl {got:.4f} rounds to {want}", file=sys.stderr)
    print(f"# {len(results)} runs, {time.perf_counter() - total_start:.0f} s", file=sys.stderr)
    print(table(results, args.texts, args.budgets, presses, args.tokens))
    failed = {k: r["error"] for k, r in results.items() if "error" in r}
    for (t, budget, name), error in failed.items():
        print(f"- {name} on {TEXTS[t].label}, budget {budget}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

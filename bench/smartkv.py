"""SmartKV: teacher-forced perplexity under a row budget.

    python bench/smartkv.py --text /work/heldout/frankenstein.txt              # quality table
    python bench/smartkv.py --text FILE --methods streaming smartkv --where smartkv streaming
                                                 # which tokens smartkv loses to streaming on

`--kv-format int4h` (or int4, fp4) runs the brain's methods on 4-bit rows, as rows named
METHOD@FORMAT beside the float ones (`--out` keeps both).

**Quality.** BOS + --tokens tokens of the text (the excerpt rule of bench/texts.py: from
character --offset, starting after the first blank line) are teacher-forced one token per
forward; the NLL of each next token is read from the logits before it is fed. Budgets are
shares of --tokens (0.25 of 1024 -> 256). The brain's policies run through `positronic eval`'s
own stream (`run_stream`: the tick loop, the token forced), so their rows are the same as in
an eval table; SmartKV runs through a plain `model(...)` call with a SmartKVCache of `budget`
rows, and through the brain (`--policy smartkv`, the same stream as the other policies).
Every method attends to at most `budget` rows per forward, the newest token included: the
brain keeps `live <= budget` rows per layer after a tick, a SmartKVCache admits a decoded
token first and attends to the at most `budget` rows it holds then.

Rows per budget: streaming / scored / h2o / brightness (the brain, each policy's defaults),
smartkv (SmartKVCache: sinks + window + long-term memory ranked by the trained per-layer
gates), smartkv-brain (the same through the brain: it must match smartkv), smartkv+recall (the
brain's smartkv with recall: dropped tokens come back into the lanes that look for them),
smartkv+recall+recent (the same, each lane's memory ranked by recent attention too: `--memory-rank
recent`, positronic/smartkv/recent.py), smartkv-keys (the same
gates, memory ranked by their predicted lifespan alone, without the value norms: what the
value norms buy), smartkv-random (the same layout, gates freshly initialised: what training buys), smartkv-shared
(one gate trained on every layer's labels pooled: what a gate per layer buys), and
smartkv-stream (sinks + window only, no gates: the same cache class as a streaming baseline).

What SmartKV costs per token against streaming is measured by bench/decode.py (`--policies
streaming smartkv --smartkv`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_kernels import describe, record, refuse_others  # noqa: E402
from positronic.kv import formats as kv_formats  # noqa: E402
from bench.texts import excerpt  # noqa: E402
from positronic.evaluate import make_config, reference_config, run_stream  # noqa: E402
from positronic.models import load_model, with_cache  # noqa: E402
from positronic.smartkv import GateSet, SmartKVCache  # noqa: E402
from positronic.smartkv.gates import SHIPPED, SHIPPED_SHARED  # noqa: E402

BRAIN_POLICIES = ("streaming", "scored", "h2o", "brightness")
METHODS = ("full", *BRAIN_POLICIES, "smartkv-brain", "smartkv+recall", "smartkv+recall+recent", "smartkv", "smartkv-keys", "smartkv-random", "smartkv-shared",
           "smartkv-stream")


@torch.inference_mode()
def nll_stream(model, ids: list[int], cache) -> list[float]:
    """NLL (nats) of ids[1:], each predicted from the tokens before it, one forward per token."""
    losses = []
    for n in range(len(ids) - 1):
        logits = model(torch.tensor([[ids[n]]]), **with_cache(cache), use_cache=True).logits[0, -1]
        losses.append(float(torch.log_softmax(logits.float(), -1)[ids[n + 1]].neg()))
    return losses


def perplexity(losses: list[float]) -> float:
    return math.exp(sum(losses) / len(losses))


def smart_caches(config, stored: int, *, sinks: int, window: int | None, gates: dict[str, GateSet],
                 horizon: int | None = None):
    """(name, cache) for each SmartKV variant holding `stored` rows (the decoded token among them);
    window None: half of them, as `--policy smartkv` does by default."""
    window = stored // 2 if window is None else window
    budget = stored - sinks - window
    if budget < 1:
        raise ValueError(f"{stored} rows leave no long-term memory after sinks {sinks} + window {window}")
    for name, gate_set in gates.items():
        yield name, SmartKVCache(config, gate_set, budget=budget, sinks=sinks, window=window, horizon=horizon)
        if name == "smartkv":
            yield "smartkv-keys", SmartKVCache(config, gate_set, budget=budget, sinks=sinks, window=window,
                                               horizon=horizon, value_norms=False)
    yield "smartkv-stream", SmartKVCache.streaming(config, capacity=stored, sinks=sinks)


def gate_sets(args, config) -> dict[str, GateSet]:
    gates = {}
    trained = args.gates or SHIPPED.get(args.model)
    if trained is not None:
        gates["smartkv"] = GateSet.load(trained)
    per_head = "smartkv" in gates and gates["smartkv"].heads > 1  # the ablation scores what the gates score
    gates["smartkv-random"] = GateSet.for_config(config, seed=args.seed, per_head=per_head)
    shared = args.shared_gates or SHIPPED_SHARED.get(args.model)
    if shared is not None:
        gates["smartkv-shared"] = GateSet.load(shared)
    for gate_set in gates.values():
        gate_set.check_model(config)
    return gates


def quality(args, lm, kernels: dict) -> None:
    """`kernels`: this run's record (bench/cpu_kernels.py), written beside its numbers."""
    config = lm.model.config
    gates = gate_sets(args, config)
    untrained = [name for name in (args.where or []) if name.startswith("smartkv") and name != "smartkv-stream"
                 and name.removesuffix("-brain") not in gates]
    if untrained:
        raise SystemExit(f"--where {' '.join(untrained)}: no such gates for {args.model} (give --gates / --shared-gates)")
    ids = [lm.bos_id] + lm.encode(excerpt(args.text, args.offset))[: args.tokens]
    count = len(ids) - 1
    print(f"# {datetime.date.today()}  model {args.model}  text {args.text.name} (from char {args.offset})  "
          f"{count} tokens scored  sinks {args.sinks}  smartkv window {args.window or 'budget/2'}  "
          f"torch threads {torch.get_num_threads()}  kernels {describe(kernels)}", flush=True)
    results: dict[tuple[str, int | None], tuple[list[float], float]] = {}  # (method, budget) -> (NLL per token, s)

    def report(name, budget, nll, seconds):
        results[name, budget] = nll, seconds
        ppl, full = perplexity(nll), perplexity(results["full", None][0])
        print(f"{name:16s} budget {budget if budget else '-':>5}  ppl {ppl:8.3f}  x{ppl / full:.3f}  "
              f"{seconds:5.0f} s", flush=True)

    start = time.perf_counter()
    full = run_stream(lm, ids, reference_config(len(ids), sinks=args.sinks))
    report("full", None, full.nll, time.perf_counter() - start)
    wanted = set(args.methods or [])
    fmt = args.kv_format
    for share in args.budgets:
        budget = round(share * count)
        brain_runs = [(p, make_config(p, budget, sinks=args.sinks, kv_format=fmt)) for p in BRAIN_POLICIES]
        if "smartkv" in gates:
            brain_config = make_config("smartkv", budget, sinks=args.sinks, gates=str(args.gates or ""), kv_format=fmt,
                                       memory_rank="gates")  # the rows name their rank: +recent below
            if args.window is not None:
                brain_config.window = args.window
            brain_runs.append(("smartkv-brain", brain_config))
            brain_runs.append(("smartkv+recall", dataclasses.replace(brain_config, recall=True)))
            brain_runs.append(("smartkv+recall+recent", dataclasses.replace(brain_config, recall=True, memory_rank="recent")))
        for name, brain_config in brain_runs:
            if wanted and name not in wanted:
                continue
            start = time.perf_counter()
            stream = run_stream(lm, ids, brain_config)
            assert stream.max_live <= budget
            report(name if fmt == "float" else f"{name}@{fmt}", budget, stream.nll, time.perf_counter() - start)
        if fmt != "float":
            continue  # SmartKVCache keeps float rows
        for name, cache in smart_caches(config, budget, sinks=args.sinks, window=args.window, gates=gates,
                                         horizon=args.horizon):
            if wanted and name not in wanted:
                continue
            start = time.perf_counter()
            nll = nll_stream(lm.model, ids, cache)
            assert cache.rows == budget and cache.seen == count
            report(name, budget, nll, time.perf_counter() - start)

    from rich.console import Console
    from rich.table import Table

    full = perplexity(results["full", None][0])
    table = Table(title=f"teacher-forced perplexity, {args.model}, {args.text.name}, {count} tokens")
    for column in ("method", "budget", "ppl", "ppl / full", "seconds"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for (name, budget), (nll, seconds) in results.items():
        ppl = perplexity(nll)
        table.add_row(name, "-" if budget is None else f"{budget} ({budget / count:.1%})", f"{ppl:.3f}",
                      f"{ppl / full:.3f}", f"{seconds:.0f}")
    Console(file=sys.stdout, width=120).print(table)
    if args.where:
        for share in args.budgets:
            where_lost(lm, ids, results, *args.where, round(share * count))
    if args.out:
        path = out_path(args)
        rows = [{"method": name, "budget": budget, "ppl": perplexity(nll), "ratio": perplexity(nll) / full,
                 "seconds": seconds, "offset": args.offset, "nll": [round(x, 6) for x in nll], "kernels": kernels}
                for (name, budget), (nll, seconds) in results.items()]
        rows = kept_rows(path, args, count, rows) + rows
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": args.model, "text": args.text.name, "tokens": count, "rows": rows},
                                   indent=1))
        plot_quality(path, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")


def out_path(args) -> Path:
    return args.out / f"smartkv_{args.text.stem}.json"


def refuse_other_kernels(args, kernels: dict) -> None:
    """SystemExit, before anything runs, if --out's file holds rows run with other CPU kernels
    (bench/cpu_kernels.py): this run's rows would sit beside them, and the table mix two kernels'
    numbers."""
    path = out_path(args)
    if path.exists():
        refuse_others(kernels, ((f"{path}: its {row['method']} row", row.get("kernels"))
                                for row in json.loads(path.read_text())["rows"]), "give another --out")


def kept_rows(path: Path, args, count: int, rows: list[dict]) -> list[dict]:
    """The rows of an earlier --out file that this run did not redo (a --methods run adds to the
    file, it does not wipe the other methods); none if that file scored other tokens (another
    model, --tokens or --offset: its rows would not compare). Rows written before they recorded
    their offset count as the same tokens when the file's full-cache perplexity is this run's."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    full = {row["method"]: row["ppl"] for row in old["rows"]}.get("full")
    now = next(row["ppl"] for row in rows if row["method"] == "full")
    same = old.get("model") == args.model and old.get("tokens") == count and all(
        row["offset"] == args.offset if "offset" in row else full is not None and math.isclose(full, now, rel_tol=1e-6)
        for row in old["rows"])
    if not same:
        print(f"{path}: its rows scored other tokens (model, --tokens or --offset): replaced", flush=True)
        return []
    redone = {(row["method"], row["budget"]) for row in rows}
    return [row for row in old["rows"] if (row["method"], row["budget"]) not in redone]


def where_lost(lm, ids: list[int], results: dict, first: str, second: str, budget: int, top: int = 12) -> None:
    """Where `first` loses to `second` at `budget` ("full": the full cache, at any budget): the NLL
    difference summed per 128 scored tokens, and the tokens with the largest differences, with the
    text before them. results: (method, budget) -> (NLL per scored token, seconds)."""
    first_nll, second_nll = (results[name, None if name == "full" else budget][0] for name in (first, second))
    diff = [a - b for a, b in zip(first_nll, second_nll)]
    print(f"NLL of {first} minus {second}, budget {budget}: {sum(diff):+.2f} nats over {len(diff)} tokens")
    print("  per 128 tokens: " + "  ".join(f"{sum(diff[k:k + 128]):+.2f}" for k in range(0, len(diff), 128)))
    for n in sorted(sorted(range(len(diff)), key=lambda n: -abs(diff[n]))[:top]):
        before = lm.tokenizer.decode(ids[max(0, n - 7):n + 1])
        print(f"  token {n + 1:5d} {diff[n]:+6.2f}  {before!r} -> {lm.tokenizer.decode([ids[n + 1]])!r}")


def plot_quality(json_path: Path, png: Path) -> None:
    """Grouped bars: perplexity / full cache per method, one group per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(json_path.read_text())
    rows = [r for r in data["rows"] if r["budget"] is not None]
    budgets = sorted({r["budget"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, method in enumerate(methods):
        values = [next((r["ratio"] for r in rows if r["method"] == method and r["budget"] == b), float("nan"))
                  for b in budgets]
        ax.bar([i + k * width for i in range(len(budgets))], values, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(budgets))],
                  [f"budget {b} ({b / data['tokens']:.1%})" for b in budgets])
    ax.set_ylabel("perplexity / full cache")
    low = min(r["ratio"] for r in rows)
    ax.set_ylim(max(0.9, low - 0.05), max(r["ratio"] for r in rows) + 0.03)
    ax.set_title(f"{data['model']}, {data['text']}, {data['tokens']} tokens teacher-forced")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_gates(png: Path) -> None:
    """Held-out Spearman per layer of the shipped gates, per-layer and shared (from their headers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.2))
    for name, table in (("per-layer gates", SHIPPED), ("one shared gate", SHIPPED_SHARED)):
        header = GateSet.load(table["smollm2"]).header
        rho = header["heldout_spearman"]
        name += ", mean of kv heads" if header["heads"] > 1 else ""
        ax.plot(range(len(rho)), rho, marker="o", label=f"{name} (mean {sum(rho) / len(rho):.3f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out Spearman")
    ax.set_title(f"SmolLM2 gates: predicted vs true lifespan rank, held out: {header.get('heldout', '?')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", type=Path, default=Path("/work/heldout/frankenstein.txt"))
    p.add_argument("--offset", type=int, default=60000, help="excerpt start (characters); 0: the whole text")
    p.add_argument("--tokens", type=int, default=1024, help="text tokens scored (BOS is added in front)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25], help="shares of --tokens")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, help="recent rows every SmartKV layer keeps (default: half the budget)")
    p.add_argument("--horizon", type=int, help="SmartKVCache rows: the lifespan horizon memory ranks by "
                   "(default: the gates' own, 512)")
    p.add_argument("--gates", type=Path, help="trained gates, per layer or per kv head (default: the shipped ones)")
    p.add_argument("--shared-gates", type=Path, help="one shared gate (default: the shipped one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random (untrained) gates")
    p.add_argument("--threads", type=int)
    p.add_argument("--methods", nargs="+", help="only these rows (e.g. smartkv smartkv-brain); full always runs")
    p.add_argument("--where", nargs=2, metavar=("A", "B"), help="also show where method A loses to method B "
                   "(per-token NLL differences at each budget)")
    p.add_argument("--out", type=Path, help="also write smartkv_TEXT.json (each row's per-token NLLs and CPU "
                   "kernels too, for bench/significance.py; rows of methods not rerun are kept; a file of rows "
                   "run with other kernels is refused) and a bar plot (.png) here")
    p.add_argument("--plot-gates", type=Path, metavar="PNG", help="only plot the shipped gates' held-out Spearman")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-format", default="float", choices=kv_formats.FORMATS,
                   help="the cache format of the brain's runs (streaming ... smartkv+recall), named METHOD@FORMAT "
                        "in the table and --out (e.g. smartkv+recall@int4h); the full cache stays float, and the "
                        "SmartKVCache rows (float only) are not run")
    args = p.parse_args(argv)
    if args.kv_format != "float":
        cache_rows = [name for name in (args.methods or []) + (args.where or [])
                      if name not in (*BRAIN_POLICIES, "smartkv-brain", "smartkv+recall", "smartkv+recall+recent", "full")]
        if cache_rows or args.where:
            p.error(f"--kv-format {args.kv_format} runs the brain's methods only "
                    + (f"(not {' '.join(cache_rows)}: SmartKVCache keeps float rows)" if cache_rows
                       else "(--where compares float runs)"))
    for name in (args.methods or []) + (args.where or []):
        if name not in METHODS:
            p.error(f"unknown method {name!r}: expected one of {', '.join(METHODS)}")
    if args.where and args.methods:
        missing = [name for name in args.where if name != "full" and name not in args.methods]
        if missing:
            p.error(f"--where {' '.join(args.where)}: add {' '.join(missing)} to --methods")
    if args.plot_gates:
        plot_gates(args.plot_gates)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = record(args.device)
    if args.out:
        refuse_other_kernels(args, kernels)
    lm = load_model(args.model, device=args.device, dtype="float32" if args.device == "cpu" else None)
    quality(args, lm, kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())

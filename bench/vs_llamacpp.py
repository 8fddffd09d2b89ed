"""Side by side with llama.cpp on the same GGUF: prompt and decode tokens/s, alternating in one sitting.

    bash bench/llamacpp_env.sh                  # once: bench/.llamacpp-venv (builds llama.cpp, minutes)
    python bench/vs_llamacpp.py                 # the embedded model's GGUF, threads 1 and 2
    python bench/vs_llamacpp.py --gguf model.Q8_0.gguf --threads 2 --weights float32 int8 --budgets 384
    python bench/vs_llamacpp.py --threads 2 --weights int8 int8-weight-only+compiled --budgets 384   # run --compile

Each round runs, in turn and for each thread count: llama.cpp (llama-cpp-python in its own
venv, a child process per run: `Llama(n_ctx=1024)`, the prompt evaluated at once, then
--tokens greedy tokens one `eval` each), and this project on the same file (`load_model(gguf,
weights=W)`, `Brain.start` on the same prompt ids, then --tokens greedy ticks) for every
--weights format and --budgets budget; and Hugging Face `generate` on the file's float32
conversion, loaded the library's default way (sdpa; --no-hf leaves it out). Budget 1024 holds prompt and reply (no eviction, as
llama.cpp's run); a budget under prompt + reply keeps the default policy evicting every tick
from the prompt on. llama.cpp runs without a context shift (its n_ctx holds everything), so
the evicting rows compare maintenance-on against llama.cpp at its fastest.

The prompt is --prompt-tokens tokens of texts/alice_ch1-2.txt (the same ids for both: one
GGUF, one vocabulary). Figures are medians over --repeats rounds; ratios are against
llama.cpp's median at the same thread count. Prints a markdown table; --json writes the runs.
Run it alone on the machine: both sides are bound by the same two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLAMACPP_PYTHON = HERE / ".llamacpp-venv" / "bin" / "python"
TEXT = ROOT / "texts" / "alice_ch1-2.txt"

# run in llama.cpp's venv: argv = gguf, threads, tokens; stdin = the prompt ids (JSON)
CHILD = """
import json, sys, time
import llama_cpp
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.stdin.read())
llm = llama_cpp.Llama(path, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
start = time.perf_counter()
llm.eval(prompt)
prompt_s = time.perf_counter() - start
out, start = [], time.perf_counter()
for _ in range(tokens):
    token = llm.sample(temp=0.0)
    out.append(token)
    llm.eval([token])
decode_s = time.perf_counter() - start
print(json.dumps({"prompt_s": prompt_s, "decode_s": decode_s, "tokens": out,
                  "system": llama_cpp.llama_print_system_info().decode().strip()}))
"""


def llamacpp_run(python: Path, gguf: Path, threads: int, prompt: list[int], tokens: int) -> dict:
    done = subprocess.run([str(python), "-c", CHILD, str(gguf), str(threads), str(tokens)], input=json.dumps(prompt),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"llama.cpp's run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def hf_run(model, threads: int, prompt: list[int], tokens: int) -> dict:
    """Hugging Face `generate` as a user calls it (the model loaded the library's default way:
    float32, sdpa, its DynamicCache), greedy: a one-token run times the prompt, a
    tokens + 1 one the rest."""
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prompt_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False)
        whole = time.perf_counter() - start
    return {"prompt_s": prompt_s, "decode_s": whole - prompt_s, "tokens": out[0, len(prompt):][:tokens].tolist()}


def project_run(lm, threads: int, prompt: list[int], tokens: int, budget: int, compiled: bool = False) -> dict:
    """`compiled`: the ticks as compiled Core v4 rounds of one (`run --compile`), the graph made
    before the clock starts (once per model, budget and thread count)."""
    import torch

    from positronic.batch import Batch
    from positronic.brain.loop import Brain, BrainConfig

    torch.set_num_threads(threads)
    config = BrainConfig(budget=budget, temperature=0.0)
    start = time.perf_counter()
    brain = Brain.start(lm, prompt, config)
    prompt_s = time.perf_counter() - start
    tick, batch = (lambda: brain.step().token_id), None  # noqa: E731
    if compiled:
        batch = Batch(compiled=True, slots=1)
        batch.join("run", brain)
        batch.warm()
        tick = lambda: batch.step()["run"].token_id  # noqa: E731
    out, start = [], time.perf_counter()
    for _ in range(tokens):
        out.append(tick())
    decode_s = time.perf_counter() - start
    rounds = 0 if batch is None else batch.seats.rounds  # the ticks that were engine rounds
    return {"prompt_s": prompt_s, "decode_s": decode_s, "tokens": out, "policy": config.policy, "rounds": rounds}


def load_compiled(gguf: Path, what: str):
    """The model for WHAT+compiled, ticking compiled rounds: --weights WHAT where a round computes
    that format (float32, int8-weight-only), else the model in dtype WHAT (bfloat16)."""
    from positronic.models import load_model
    from positronic.models.compiled import ROUND_WEIGHTS

    if what in ROUND_WEIGHTS:
        return load_model(str(gguf), device="cpu", weights=what)
    return load_model(str(gguf), device="cpu", dtype=what, weights="float32")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the embedded model's)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--weights", nargs="+", default=["float32", "int8"],  # int4: see docs/weights.md
                        help="float32 | bfloat16 | int8 | int8-weight-only | int4, or W+compiled (float32+compiled, "
                             "int8-weight-only+compiled, bfloat16+compiled): ticking compiled Core v4 rounds (run "
                             "--compile --weights W, or --dtype bfloat16)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 384])
    parser.add_argument("--prompt-tokens", type=int, default=450)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llamacpp-python", type=Path, default=LLAMACPP_PYTHON)
    parser.add_argument("--no-hf", action="store_true", help="leave out Hugging Face generate (float32, sdpa)")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args(argv)
    if not args.llamacpp_python.is_file():
        parser.error(f"{args.llamacpp_python} not found: run `bash bench/llamacpp_env.sh` first")

    from positronic.models import load_model, smollm2_gguf

    gguf = (args.gguf or smollm2_gguf()).resolve()
    models = {w: load_compiled(gguf, w.removesuffix("+compiled")) if w.endswith("+compiled") else
              load_model(str(gguf), device="cpu", weights=w) for w in args.weights}
    hf = None
    if not args.no_hf:  # the same converted weights, loaded as transformers loads them by default
        from transformers import AutoModelForCausalLM

        from positronic.models import gguf_cache
        hf = AutoModelForCausalLM.from_pretrained(str(gguf_cache(gguf))).eval()
    lm = next(iter(models.values()))
    prompt = [lm.bos_id] + lm.encode(TEXT.read_text(encoding="utf-8"))[: args.prompt_tokens - 1]
    runs: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):
        for threads in args.threads:
            key = ("llama.cpp", "gguf", 0, threads)
            runs.setdefault(key, []).append(llamacpp_run(args.llamacpp_python, gguf, threads, prompt, args.tokens))
            print(f"round {repeat + 1}: llama.cpp, {threads} threads: {_line(runs[key][-1], len(prompt))}",
                  file=sys.stderr, flush=True)
            if hf is not None:
                key = ("hf generate", "float32", 0, threads)
                runs.setdefault(key, []).append(hf_run(hf, threads, prompt, args.tokens))
                print(f"round {repeat + 1}: hf generate, {threads} threads: {_line(runs[key][-1], len(prompt))}",
                      file=sys.stderr, flush=True)
            for weights, model in models.items():
                for budget in args.budgets:
                    key = ("project", weights, budget, threads)
                    runs.setdefault(key, []).append(project_run(model, threads, prompt, args.tokens, budget,
                                                                compiled=weights.endswith("+compiled")))
                    print(f"round {repeat + 1}: project {weights}, budget {budget}, {threads} threads: "
                          f"{_line(runs[key][-1], len(prompt))}", file=sys.stderr, flush=True)
    print(table(runs, len(prompt), args.tokens, gguf))
    if args.json:
        args.json.write_text(json.dumps([{"engine": k[0], "weights": k[1], "budget": k[2], "threads": k[3], **r}
                                         for k, rs in runs.items() for r in rs], indent=1))
    return 0


def _line(run: dict, prompt: int) -> str:
    return f"prompt {prompt / run['prompt_s']:.0f} tok/s, decode {len(run['tokens']) / run['decode_s']:.1f} tok/s"


def table(runs: dict, prompt: int, tokens: int, gguf: Path) -> str:
    def median(key, what):
        return statistics.median((prompt if what == "prompt_s" else tokens) / r[what] for r in runs[key])

    lines = [f"{gguf.name}: {prompt}-token prompt, {tokens} greedy tokens; medians of {len(next(iter(runs.values())))} rounds",
             "", "| engine | weights | budget | threads | prompt tok/s | decode tok/s | decode × llama.cpp | "
             "tokens = float32's |", "|---|---|---|---|---|---|---|---|"]
    for key in runs:
        engine, weights, budget, threads = key
        base = median(("llama.cpp", "gguf", 0, threads), "decode_s")
        reference = runs.get(("project", "float32", budget or 1024, threads))
        same = "" if engine == "llama.cpp" or not reference else \
            f"{sum(a == b for a, b in zip(runs[key][0]['tokens'], reference[0]['tokens']))}/{tokens}"
        lines.append(f"| {engine} | {weights} | {budget or ('n_ctx 1024' if engine == 'llama.cpp' else 'full')} | {threads} | {median(key, 'prompt_s'):.0f} | "
                     f"{median(key, 'decode_s'):.1f} | {median(key, 'decode_s') / base:.2f} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

"""EleutherAI's lm-evaluation-harness against `positronic serve`, beside lm-eval's own `hf`
model on the same tasks and weights.

    python bench/lm_eval_server.py                           # the embedded SmolLM2, budget 2048
    python bench/lm_eval_server.py --budget 48 --fewshot 8 --write   # prompts past the budget, recorded

lm-eval is not a dependency of the project: it runs in a virtualenv of its own
(bench/.lm-eval-venv, made on first use: torch 2.13.0 CPU, then `lm-eval[hf,api]`; or
--lm-eval-python). Two tasks are written from this file into a temporary directory (no
downloads): `positronic_antonyms`, multiple choice, scored by loglikelihood (the server's
`echo` + `logprobs`), and `positronic_counting`, `generate_until` (greedy text up to a comma:
the next number of "3, 4, 5, 6,"), scored by exact match. lm-eval drives the server with `--model local-completions`
(tokenized requests, the model's own tokenizer directory), then evaluates the same tasks with
`--model hf` on the same weights (`add_bos_token=True`: the server reads every prompt after a
BOS). With a budget above every prompt the two must agree; below it, the server's numbers are
what its policy's memory gives. Prints a table; --write appends it as a dated section at the end
of the notebook, bench/results/history/lm_eval.md (the one-screen page, bench/results/lm_eval.md,
is edited by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".lm-eval-venv"
RESULTS = ROOT / "bench" / "results" / "history" / "lm_eval.md"  # the notebook; the page is hand-edited

ANTONYMS = [("hot", "cold"), ("up", "down"), ("big", "small"), ("day", "night"), ("fast", "slow"),
            ("happy", "sad"), ("light", "dark"), ("old", "young"), ("open", "closed"), ("early", "late"),
            ("full", "empty"), ("hard", "soft"), ("high", "low"), ("long", "short"), ("rich", "poor"),
            ("strong", "weak"), ("wet", "dry"), ("win", "lose"), ("push", "pull"), ("black", "white"),
            ("left", "right"), ("first", "last"), ("true", "false"), ("love", "hate")]
SEQUENCES = [(start, step) for step in (1, 2) for start in range(1, 11)]  # "3, 4, 5, 6," -> 7

# what both tasks share: a local JSON-lines file ({data}), its items both the test and the few-shot pool
TASK_HEAD = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
"""

MC_TASK = """task: positronic_antonyms
output_type: multiple_choice
doc_to_text: "The opposite of {{{{word}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """task: positronic_counting
output_type: generate_until
doc_to_text: "Numbers: {{{{numbers}}}},"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [",", "\\n"]
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(directory: Path) -> None:
    """The two tasks and their data (written here, not downloaded)."""
    with open(directory / "antonyms.jsonl", "w") as f:
        for i, (word, opposite) in enumerate(ANTONYMS):
            others = [ANTONYMS[(i + k) % len(ANTONYMS)][1] for k in (5, 11, 17)]
            choices = others[:i % 4] + [opposite] + others[i % 4:]
            f.write(json.dumps({"word": word, "choices": choices, "label": i % 4}) + "\n")
    with open(directory / "counting.jsonl", "w") as f:
        for start, step in SEQUENCES:
            numbers = [start + step * k for k in range(4)]
            f.write(json.dumps({"numbers": ", ".join(map(str, numbers)), "answer": str(numbers[-1] + step)}) + "\n")
    for name, task in (("antonyms", MC_TASK), ("counting", GEN_TASK)):
        (directory / f"{name}.yaml").write_text(TASK_HEAD.format(data=directory / f"{name}.jsonl")
                                                 + task.replace("{{{{", "{{").replace("}}}}", "}}"))


def lm_eval_python(given: str | None) -> str:
    """An interpreter with lm-eval: --lm-eval-python, or bench/.lm-eval-venv (made if missing)."""
    if given:
        return given
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"making {VENV} (torch 2.13.0 CPU, lm-eval[hf,api]): a few minutes, once", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "lm-eval[hf,api]"], check=True)
    return str(python)


def start_server(model: str, budget: int, sessions: Path, threads: int) -> tuple[subprocess.Popen, str, Path]:
    log = sessions.parent / "serve.log"
    command = [sys.executable, str(ROOT / "run.py"), "serve", "-m", model, "--port", "0", "--budget", str(budget),
               "--session-dir", str(sessions), "-t", str(threads)]
    with open(log, "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if found := re.search(r"running on (http://\S+)", log.read_text()):
            return process, found.group(1), log
        if process.poll() is not None:
            raise SystemExit(f"serve exited {process.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    process.kill()
    raise SystemExit("serve did not start in 300 s")


def evaluate(python: str, model_name: str, model_args: str, tasks: Path, out: Path, limit: int | None,
             fewshot: int) -> dict:
    """lm_eval's results for both tasks: {task: (metric, value)}."""
    command = [python, "-m", "lm_eval", "--model", model_name, "--model_args", model_args, "--tasks",
               "positronic_antonyms,positronic_counting", "--include_path", str(tasks), "--output_path", str(out),
               "--batch_size", "1", "--device", "cpu", "--num_fewshot", str(fewshot)]
    if limit:
        command += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval ({model_name}) exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    (result,) = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)[-1:]
    data = json.loads(result.read_text())["results"]
    seconds = time.perf_counter() - start
    return {"antonyms": data["positronic_antonyms"]["acc,none"], "counting": data["positronic_counting"]["exact_match,number"],
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="the served model (its HF directory is given to lm-eval)")
    parser.add_argument("--budget", type=int, default=2048, help="the server's context budget")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    parser.add_argument("--fewshot", type=int, default=0, help="examples before each item (longer prompts: "
                        "with 8, about 100 tokens, past a small budget)")
    parser.add_argument("--lm-eval-python", default=None, help="an interpreter with lm-eval installed")
    parser.add_argument("--write", action="store_true",
                        help=f"append the table as a dated section at the end of {RESULTS.relative_to(ROOT)} "
                        "(the notebook; bench/results/lm_eval.md is edited by hand)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from positronic.models.smollm2 import smollm2_cache

    if args.model != "smollm2":
        raise SystemExit("only the embedded smollm2 is wired up here (its converted HF directory is the tokenizer)")
    weights = smollm2_cache()
    python = lm_eval_python(args.lm_eval_python)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        tasks = scratch / "tasks"
        tasks.mkdir()
        write_tasks(tasks)
        process, url, log = start_server(args.model, args.budget, scratch / "sessions", args.threads)
        try:
            served = evaluate(python, "local-completions",
                              f"base_url={url}/v1/completions,model={args.model},tokenizer={weights},"
                              "tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=4096",
                              tasks, scratch / "served", args.limit, args.fewshot)
        finally:
            process.terminate()
            process.wait(60)
        reference = evaluate(python, "hf", f"pretrained={weights},dtype=float32,add_bos_token=True",
                             tasks, scratch / "hf", args.limit, args.fewshot)
    load = os.getloadavg()
    rows = [("positronic serve (local-completions)", served), ("lm-eval hf", reference)]
    lines = [f"model {args.model}, server budget {args.budget}, {args.fewshot}-shot, {args.limit or 'all'} items per task "
             f"({len(ANTONYMS)} antonyms, {len(SEQUENCES)} counting); {platform.machine()} {os.cpu_count()} cores, load "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", "",
             "| lm-eval model | antonyms acc (loglikelihood) | counting exact match (generate_until) | wall s |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {r['antonyms']:.4f} | {r['counting']:.4f} | {r['seconds']:.0f} |" for name, r in rows]
    same = served["antonyms"] == reference["antonyms"] and served["counting"] == reference["counting"]
    lines += ["", f"equal: {'yes' if same else 'no'} (antonyms {served['antonyms'] / max(reference['antonyms'], 1e-9):.3f}x, "
                  f"counting {served['counting'] / max(reference['counting'], 1e-9):.3f}x of hf)"]
    print("\n".join(lines))
    if args.write:
        with open(RESULTS, "a") as f:
            f.write(f"\n## {time.strftime('%Y-%m-%d')}: `python bench/lm_eval_server.py --budget {args.budget} "
                    f"--fewshot {args.fewshot}`\n\n"
                    + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

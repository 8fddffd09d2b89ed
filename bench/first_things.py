"""The first things a new user types, coming from llama.cpp, vLLM, the openai client or kvpress:
each run as typed (a command, or a request to a server started as a user starts one), judged
by what that user expects to see.

    python bench/first_things.py [--out bench/results/first_things.md] [--only WORD ...]

Prints one line per thing (PASS / FAIL, what was typed, what was seen when it failed) and the
count; with --out writes the same as a Markdown table. Run it on a fresh clone after
`make setup` (it uses the venv's python, random:tiny for most things and the embedded model
where the thing is about it). Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, str(ROOT / "run.py")]
TINY = ["-m", "random:tiny", "--no-tui"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}  # closed: a random model never ends an open object by itself


@dataclass
class Outcome:
    what: str
    passed: bool
    seen: str = ""


def command(*args: str, stdin: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=timeout)


def shown(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:160]}"


def cli_things(tmp: Path) -> list[tuple[str, callable]]:
    prompt_file = tmp / "prompt.txt"
    prompt_file.write_text("Once upon a time")

    def runs(*args, stdin="", expect=None):
        def check():
            done = command(*args, stdin=stdin)
            ok = done.returncode == 0 and (expect is None or expect(done))
            return ok, "" if ok else shown(done) + f" | stdout {done.stdout[-160:]!r}"
        return check

    return [
        ('echo "What is the capital of France?" | python run.py --no-tui -n 12',
         runs("--no-tui", "-n", "12", stdin="What is the capital of France?\n",
              expect=lambda d: "conversation mode" in d.stderr and "<|im_start|>" not in d.stdout and d.stdout.strip())),
        ("python run.py -m random:tiny --ctx-size 64 --n-predict 8", runs(*TINY, "--ctx-size", "64", "--n-predict", "8",
                                                                         "--no-input")),
        ("python run.py ... --temp 0.7 --repeat-penalty 1.1 -s 3", runs(*TINY, "-n", "8", "--temp", "0.7",
                                                                         "--repeat-penalty", "1.1", "-s", "3",
                                                                         "--no-input")),
        ("python run.py ... -f prompt.txt", runs(*TINY, "-n", "4", "-f", str(prompt_file), "--no-input",
                                                 expect=lambda d: d.stdout.startswith("Once upon a time"))),
        ("python run.py ... --file prompt.txt --keep 4", runs(*TINY, "-n", "4", "--file", str(prompt_file), "--keep",
                                                              "4", "--no-input")),
        ("python run.py ... -ngl 0", runs(*TINY, "-n", "4", "-ngl", "0", "--no-input")),
        ("printf 'hi\\nbye\\n' | python run.py ... -i --chat-template chatml -n 5",
         runs(*TINY, "-i", "--chat-template", "chatml", "-n", "5", stdin="hi\nbye\n",
              expect=lambda d: d.stdout.count("\n") == 2 and "replies 2" in d.stderr)),
        ("printf 'hi\\n' | python run.py ... -cnv --chat-template llama3 --ignore-eos -n 5",
         runs(*TINY, "-cnv", "--chat-template", "llama3", "--ignore-eos", "-n", "5", stdin="hi\n")),
        ("python run.py ... -p 'Data:' -j SCHEMA", runs(*TINY, "-n", "80", "-p", "Data:", "-j", json.dumps(SCHEMA),
                                                        "--no-input", expect=lambda d: set(json.loads(
                                                            d.stdout.split("\n--- summary")[0][5:])) == {"name", "age"})),
        ("python run.py ... --grammar 'root ::= (\"yes\" | \"no\") \".\"'",
         runs(*TINY, "-n", "20", "-p", "Q:", "--grammar", 'root ::= ("yes" | "no") "."', "--no-input",
              expect=lambda d: re.match(r"Q:(yes|no)\.\n", d.stdout) is not None)),
        ("python run.py --help (names llama.cpp's flags)", runs("--help", expect=lambda d: all(
            flag in d.stdout for flag in ("--ctx-size", "--n-predict", "--repeat-penalty", "--chat-template",
                                          "--json-schema")))),
    ]


def wheel_things(tmp: Path) -> list[tuple[str, callable]]:
    """A user of the package, not the checkout: the wheel installed in a fresh venv (whose
    dependencies are this interpreter's, through a .pth file: installing torch again would take
    minutes), an empty model cache, then the two commands its error message and docs name."""
    def from_the_wheel():
        import sysconfig
        import venv

        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "wheels"), str(ROOT)], check=True, capture_output=True, timeout=300)
        venv.create(tmp / "venv", with_pip=False)
        python = tmp / "venv" / "bin" / "python"
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        (Path(site) / "_outer.pth").write_text("".join(f"{p}\n" for p in outer))
        subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q",
                        *(tmp / "wheels").glob("positronic_brain-*.whl")], check=True, capture_output=True)
        env = {**os.environ, "POSITRONIC_CACHE": str(tmp / "cache")}

        def positronic(*args):
            return subprocess.run([tmp / "venv" / "bin" / "positronic", *args], cwd=tmp, env=env, capture_output=True,
                                  text=True, timeout=600)
        before, fetch, run = positronic("-n", "8", "--no-tui", "--no-input"), positronic("fetch-model"), None
        if fetch.returncode == 0:
            run = positronic("-n", "8", "--no-tui", "--no-input")
        ok = (before.returncode == 2 and "positronic fetch-model" in before.stderr and fetch.returncode == 0
              and run.returncode == 0 and run.stdout.strip() != "")
        return ok, "" if ok else " | ".join(shown(d) for d in (before, fetch, run) if d is not None)

    return [("pip install positronic-brain; positronic -n 8 (names fetch-model); positronic fetch-model; "
             "positronic -n 8", from_the_wheel)]


def server_things(url: str) -> list[tuple[str, callable]]:
    import httpx
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def post(path, body):
        return httpx.post(url + path, json=body, timeout=120)

    def chat(**fields):
        return post("/v1/chat/completions", {"model": "tiny", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "hi"}], **fields})

    def refused(field, response):
        return response.status_code == 400 and response.json()["error"]["param"] == field

    def structured(response):
        return set(json.loads(response.json()["choices"][0]["message"]["content"])) == {"name", "age"}

    metrics = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               'vllm:request_success_total{finished_reason="length"', "vllm:time_to_first_token_seconds")
    return [
        ("GET /v1/models (serve --served-model-name tiny positronic)",
         lambda: {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]} == {"tiny", "positronic"}),
        ("openai client: chat.completions.create(model='positronic', ...)",
         lambda: client.chat.completions.create(model="positronic", max_tokens=5, messages=[
             {"role": "user", "content": "hi"}]).choices[0].message.content is not None),
        ("openai client: a streamed chat", lambda: len([c for c in client.chat.completions.create(
            model="tiny", max_tokens=5, stream=True, messages=[{"role": "user", "content": "hi"}])]) >= 3),
        ("openai client: completions with a list of prompts", lambda: len(client.completions.create(
            model="tiny", prompt=["one", "two", "three"], max_tokens=3).choices) == 3),
        ("completions: n = 2, logprobs and echo", lambda: len(post("/v1/completions", {
            "model": "tiny", "prompt": "a b", "max_tokens": 3, "n": 2, "logprobs": 2, "echo": True}).json()[
            "choices"]) == 2),
        ("response_format json_object", lambda: chat(response_format={"type": "json_object"}, max_tokens=60,
                                                     temperature=0).status_code == 200),
        ("response_format json_schema", lambda: structured(chat(max_tokens=80, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}))),
        ("openai client: chat.completions.parse(response_format=PydanticModel)", lambda: _parse(client)),
        ("llama-server's grammar (GBNF)", lambda: re.fullmatch(r"(yes|no)", post("/v1/completions", {
            "model": "tiny", "prompt": "Q:", "max_tokens": 8, "grammar": 'root ::= "yes" | "no"'}).json()[
            "choices"][0]["text"]) is not None),
        ("vLLM's guided_choice / structured_outputs", lambda: chat(guided_choice=["red", "blue"]).json()[
            "choices"][0]["message"]["content"] in ("red", "blue") and structured(chat(
                max_tokens=80, structured_outputs={"json": SCHEMA}))),
        ("tools with tool_choice required", lambda: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required",
            max_tokens=80).choices[0].finish_reason == "tool_calls"),
        ("add_generation_prompt: false is refused by name", lambda: refused("add_generation_prompt", chat(
            add_generation_prompt=False))),
        ("skip_special_tokens: true is refused by name", lambda: refused("skip_special_tokens", chat(
            skip_special_tokens=True))),
        ("a field nobody implements is refused by name", lambda: refused("guided_decoding_backend", chat(
            guided_decoding_backend="xgrammar"))),
        ("GET /metrics has vLLM's names", lambda: all(name in httpx.get(url + "/metrics").text for name in metrics)),
    ]


def _parse(client) -> bool:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=99)
    reply = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Who?"}], max_tokens=80,
                                          response_format=Person)
    return isinstance(reply.choices[0].message.parsed, Person)


def library_things() -> list[tuple[str, callable]]:
    def same_as_plain_generate():
        import torch

        from positronic import SpliceCache, load_model, with_cache
        lm = load_model("random:tiny")
        ids = torch.tensor([[lm.bos_id, 5, 6, 7, 8]])
        plain = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
        cached = lm.model.generate(ids, max_new_tokens=8, do_sample=False,
                                   **with_cache(SpliceCache(lm.model.config, max_cache_len=64)))
        return torch.equal(plain, cached)

    def batch_of_four(model: str, policy: str, budget: int, chars: int):
        def check():
            import torch

            import positronic
            lm = positronic.load_model(model)
            text = (ROOT / "texts" / "alice_ch1-2.txt").read_text(encoding="utf-8")
            prompts = [[lm.bos_id] + lm.encode(text[i * chars:(i + 1) * chars + chars // 3 * i]) for i in range(4)]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with positronic.press(lm, policy=policy, budget=budget):
                out = lm.model.generate(ids, attention_mask=mask, max_new_tokens=12)
                alone = [lm.model.generate(torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist()
                         for p in prompts]
            got = [out[i, width:width + len(a)].tolist() for i, a in enumerate(alone)]
            return got == alone, "" if got == alone else f"rows equal alone: {[g == a for g, a in zip(got, alone)]}"
        return check

    return [
        ("model.generate(ids, **with_cache(SpliceCache(...))): the tokens of plain generate", same_as_plain_generate),
        ("with positronic.press(load_model('smollm2'), budget=128): generate(4 padded rows) = each row alone "
         "(the default policy)", batch_of_four("smollm2", "default", 128, 600)),
        ("with positronic.press(model, tokenizer, policy='h2o', budget=64): generate(4 rows) = each row alone",
         batch_of_four("random:tiny", "h2o", 64, 120)),
    ]


def serve(tmp: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([*RUN, "serve", "-m", "random:tiny", "--port", "0", "--served-model-name", "tiny",
                                "positronic", "--session-dir", str(tmp / "sessions"), "--max-tokens", "400"],
                               cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 120
    for line in process.stderr:
        if found := re.search(r"running on (http://\S+)", line):
            return process, found.group(1)
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError("the server never said where it runs")


def attempt(what: str, check) -> Outcome:
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001  (a thing that raises is a thing that failed: say how)
        return Outcome(what, False, f"{type(exc).__name__}: {str(exc)[:200]}")
    passed, seen = result if isinstance(result, tuple) else (bool(result), "")
    return Outcome(what, bool(passed), seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*", default=(), help="only the things whose text has one of these words")
    args = parser.parse_args()
    outcomes = []

    def wanted(what: str) -> bool:
        return not args.only or any(word in what for word in args.only)

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for what, check in cli_things(tmp) + wheel_things(tmp) + library_things():
            if wanted(what):
                outcomes.append(attempt(what, check))
                print(("PASS " if outcomes[-1].passed else "FAIL ") + what, flush=True)
        things = [thing for thing in server_things("") if wanted(thing[0])]
        if things:
            process, url = serve(tmp)
            try:
                for what, check in server_things(url):
                    if wanted(what):
                        outcomes.append(attempt(what, check))
                        print(("PASS " if outcomes[-1].passed else "FAIL ") + what, flush=True)
            finally:
                process.terminate()
                process.wait(30)
    for outcome in outcomes:
        if not outcome.passed and outcome.seen:
            print(f"  {outcome.what}: {outcome.seen}")
    passed = sum(o.passed for o in outcomes)
    print(f"{passed} of {len(outcomes)} pass")
    if args.out:
        lines = ["| | what a new user types | seen when it failed |", "|---|---|---|"]
        lines += [f"| {'pass' if o.passed else '**fail**'} | `{o.what.replace('|', chr(92) + '|')}` | "
                  f"{o.seen.replace('|', '/')} |"
                  for o in outcomes]
        args.out.write_text("\n".join(lines) + f"\n\n{passed} of {len(outcomes)} pass.\n")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

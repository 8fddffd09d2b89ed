"""bench/vs_llamacpp.py stays runnable where llama.cpp is not built (CI): it says how to build
it, and its table reads runs of both engines as it prints them."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import vs_llamacpp  # noqa: E402


def test_without_llama_cpps_venv_it_says_how_to_build_it(run_script, tmp_path):
    done = run_script("vs_llamacpp", "--llamacpp-python", str(tmp_path / "none" / "python"))
    assert done.returncode == 2 and "run `bash bench/llamacpp_env.sh` first" in done.stderr


def test_the_table_gives_tok_s_and_ratios_against_llama_cpp_at_the_same_threads():
    def run(prompt_s, decode_s, tokens):
        return {"prompt_s": prompt_s, "decode_s": decode_s, "tokens": tokens}
    runs = {("llama.cpp", "gguf", 0, 2): [run(1.0, 2.0, [1, 2, 3, 4])],
            ("project", "float32", 384, 2): [run(0.5, 8.0, [1, 2, 3, 4])],
            ("project", "int8", 384, 2): [run(0.5, 4.0, [1, 2, 9, 9])]}
    lines = vs_llamacpp.table(runs, prompt=100, tokens=4, gguf=Path("m.gguf")).splitlines()
    assert lines[0].startswith("m.gguf: 100-token prompt, 4 greedy tokens")
    assert "| llama.cpp | gguf | n_ctx 1024 | 2 | 100 | 2.0 | 1.00 |  |" in lines
    assert "| project | float32 | 384 | 2 | 200 | 0.5 | 0.25 | 4/4 |" in lines
    assert "| project | int8 | 384 | 2 | 200 | 1.0 | 0.50 | 2/4 |" in lines


def test_the_projects_compiled_run_makes_its_own_ticks_tokens(tiny):
    """`--weights float32+compiled`: the ticks as compiled rounds of one (run --compile), the
    compile before the clock; greedy on random:tiny, the tokens of the brain's own ticks."""
    import torch

    threads = torch.get_num_threads()
    try:
        prompt = [tiny.bos_id] + list(range(30, 70))
        own = vs_llamacpp.project_run(tiny, 1, prompt, 12, 48)
        compiled = vs_llamacpp.project_run(tiny, 1, prompt, 12, 48, compiled=True)
    finally:
        torch.set_num_threads(threads)
    assert compiled["tokens"] == own["tokens"] and len(own["tokens"]) == 12 and compiled["decode_s"] > 0
    assert compiled["rounds"] == 12 and own["rounds"] == 0, "the compiled run's ticks were engine rounds"

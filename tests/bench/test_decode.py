"""bench/decode.py stays runnable: a tiny run prints every row with its ratios and shares."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_decode_bench_prints_the_table_for_every_run(run_script):
    out = run_script("decode", "--model", "random:tiny", "--contexts",
                     "64", "--ticks", "8", "--repeats", "1", "--batches", "1", "4", "--repairers", "none", "bridge",
                     "--recall", "32", "--policies", "streaming", "smartkv", "smartkv+recall", "brightness",
                     "--smartkv", check=True).stdout
    lines = [line for line in out.splitlines() if line.strip().startswith("64 (")]
    names = ["(a) hf-generate (sdpa)", "(b) loop, maintenance off", "(c) maintenance on, batch 1, none",
             "(c) maintenance on, batch 1, bridge", "(c) maintenance on, batch 4, none",
             "(c) maintenance on, batch 4, bridge", "(d) (c) + recall, 32 in index", "(d) (c) + recall, 32 in index",
             "(e) policy streaming", "(e) policy smartkv", "(e) policy smartkv+recall", "(e) policy brightness",
             "(f) hf-generate + SmartKVCache streaming",
             "(f) hf-generate + SmartKVCache gates"]
    assert len(lines) == len(names) and all(name in line for name, line in zip(names, lines))
    rows = [line.split() for line in lines]
    for row in rows:
        assert any(cell.endswith("x") for cell in row), row  # the ratio against generate
    for row in rows[2:12]:
        shares = [float(cell[:-1]) for cell in row if cell.endswith("%")]
        extra = "bridge" in row or "recall," in row
        assert len(shares) == (5 if extra else 4), row  # apply, step4 (+ repair's or recall's extra), recall, choose
        assert all(0 <= s <= 100 for s in shares[:2])
        recalls = "recall," in row or "smartkv+recall" in row
        assert (shares[-2] > 0) == recalls, "recall's own share only where recall runs"
        assert 0 < shares[-1] < 100, "every policy spends something choosing rows"
    streaming_cache, gated_cache = ([cell for cell in row if cell.endswith("%")] for row in rows[12:])
    assert streaming_cache == [] and len(gated_cache) == 1 and 0 < float(gated_cache[0][:-1]) < 100  # gate scoring
    assert "smartkv gates: untrained" in out  # random:tiny has no shipped gates: said, not hidden
    for label in ("brain --policy smartkv / --policy streaming: x", "brain --policy smartkv --recall / --policy streaming: x",
                  "SmartKVCache with gates / streaming, in generate: x"):
        assert float(out.split(label)[1].split()[0]) > 0


def test_smartkv_rows_are_skipped_with_a_line_where_their_windows_pass_the_model_positions(run_script):
    """random:tiny has 512 positions: at a context of 256, a warm-up window of 128 and a timed one
    end past them, so the smartkv rows go (said in a line) and every other row stays."""
    out = run_script("decode", "--model", "random:tiny", "--contexts",
                     "256", "--ticks", "4", "--repeats", "1", "--batches", "1", "--repairers", "none",
                     "--policies", "smartkv", "streaming", "--smartkv", check=True).stdout
    assert "256 smartkv skipped: a window of warm-up and the timed windows go beyond the model's 512 positions" in out
    names = [line.split(None, 1)[1] for line in out.splitlines() if line.strip().startswith("256 (")]
    assert [name.split("  ")[0] for name in names] == ["(a) hf-generate (sdpa)", "(b) loop, maintenance off",
                                                       "(c) maintenance on, batch 1, none", "(e) policy streaming"]


def test_paired_ticks_print_each_round_and_the_median_ratio(run_script):
    """(g): the policies' brains tick in turn; every round gives each one's ms and the ratio to
    the first, then the median over rounds, and nothing of (a)-(f) runs."""
    out = run_script("decode", "--model", "random:tiny", "--contexts",
                     "64", "--paired", "8", "--repeats", "2", "--policies", "streaming", "smartkv+recall", check=True).stdout
    rounds = [line for line in out.splitlines() if "(g) round" in line]
    assert len(rounds) == 2 and all("32 ticks each" in line for line in rounds)  # one window of smartkv at 64
    ratios = [float(line.rsplit(" x", 1)[1]) for line in rounds]
    for line, ratio in zip(rounds, ratios):
        streaming, recall = (float(line.split(f"{p} ")[1].split(" ms")[0]) for p in ("streaming", "smartkv+recall"))
        assert abs(recall / streaming - ratio) < 0.01  # the ms are printed to 2 decimals
    median = float(out.split("ticking in turn: x")[1].split()[0])
    assert abs(median - sorted(ratios)[0] - (sorted(ratios)[1] - sorted(ratios)[0]) / 2) < 2e-3
    assert "(a) hf-generate" not in out and "ms/tok" not in out


def test_batched_rows_give_a_token_s_cost_beside_the_same_brain_alone(run_script):
    """(h): B brains as (c) and as each policy tick as one Batch; each row's ms is per generated
    token, and its ratio line is that over the same brain's tick alone."""
    out = run_script("decode", "--model", "random:tiny", "--contexts",
                     "64", "--ticks", "8", "--repeats", "1", "--batches", "4", "--repairers", "none",
                     "--policies", "streaming", "--sequences", "1", "3", check=True).stdout
    rows = [re.match(r"\s*64 (\(.+?)\s{2,}([\d.]+) ", line) for line in out.splitlines()]
    ms = {row[1]: float(row[2]) for row in rows if row}  # run -> its ms/tok
    assert [name for name in ms if name.startswith("(h)")] == [
        "(h) 1 batched, (c) batch 4", "(h) 3 batched, (c) batch 4", "(h) 1 batched, streaming", "(h) 3 batched, streaming"]
    for size in (1, 3):
        for label, alone, batched in ((f"(c) {size} batched", "(c) maintenance on, batch 4, none", f"(h) {size} batched, (c) batch 4"),
                                      (f"policy streaming {size} batched", "(e) policy streaming", f"(h) {size} batched, streaming")):
            ratio = float(out.split(f"{label}, per token / alone: x")[1].split()[0])
            assert abs(ratio - ms[batched] / ms[alone]) < 0.01 * ratio + 0.002  # one round: the printed ms' ratio


@pytest.mark.parametrize("flags, message", [
    (["--paired", "-4", "--policies", "streaming", "smartkv"], "--paired takes a number of ticks >= 1, got -4"),
    (["--paired", "8", "--policies", "streaming"], "--paired ticks two or more --policies in turn"),
    (["--sequences", "8", "0"], "--sequences takes batch sizes >= 1, got 8 0"),
    (["--paired", "8", "--policies", "streaming", "smartkv", "--sequences", "8"], "--sequences adds (h) to the table"),
])
def test_paired_refuses_what_it_cannot_run_with_one_line(flags, message, run_script):
    out = run_script("decode", "--model", "random:tiny", *flags)
    assert out.returncode == 2 and message in out.stderr and not out.stdout


def test_generate_is_measured_on_a_default_model_of_its_own(tiny):
    """(a) runs transformers' own "sdpa" attention on a model object of its own with the same
    weights; building it leaves the brain's model (and its attention) as it was."""
    sys.path.insert(0, str(ROOT))
    import torch

    from bench.decode import default_model
    from positronic.models import attention

    hf = default_model(tiny)
    assert hf is not tiny.model and hf.config is not tiny.model.config
    assert hf.config._attn_implementation == "sdpa"
    assert tiny.model.config._attn_implementation == attention.ATTENTION
    ids = torch.tensor([[tiny.bos_id, 5, 9, 77, 3, 41]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, tiny.model(ids).logits, rtol=0, atol=1e-5)


def test_decode_bench_compiled_adds_a_row_per_policy_against_the_brain_alone(run_script):
    """--compiled: (i), each brain of (c) and (e) alone in compiled engine rounds (B = 1), with
    its ratio to the same brain ticking alone, eager: compiled against eager in the same run."""
    out = run_script("decode", "--model", "random:tiny", "--contexts", "64", "--ticks", "8", "--repeats", "1",
                     "--batches", "4", "--repairers", "none", "--policies", "streaming", "smartkv+recall",
                     "--compiled", check=True).stdout
    rows = [line for line in out.splitlines() if "(i) 1 compiled" in line]
    assert [row.split("compiled, ")[1].split()[0] for row in rows] == ["(c)", "streaming", "smartkv+recall"]
    for row in rows:  # ms per token, tokens/s, the ratio to generate
        ms, per_second = map(float, re.search(r"\s(\d+\.\d+)\s+(\d+\.\d+)\s+\d+\.\d+x", row).groups())
        assert ms > 0 and abs(ms * per_second - 1000) < 5
    ratios = [line for line in out.splitlines() if "1 compiled, per token / alone eager: x" in line]
    assert len(ratios) == 3 and all(float(line.rsplit("x", 1)[1]) > 0 for line in ratios)

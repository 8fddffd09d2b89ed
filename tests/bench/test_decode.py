"""bench/decode.py stays runnable: a tiny run prints every row with its ratios and shares."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_bench_prints_the_table_for_every_run():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--model", "random:tiny", "--contexts",
                          "64", "--ticks", "8", "--repeats", "1", "--batches", "1", "4", "--repairers", "none", "bridge",
                          "--recall", "32"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    lines = [line for line in out.splitlines() if line.strip().startswith("64 ")]
    names = ["(a) hf-generate (sdpa)", "(b) loop, maintenance off", "(c) maintenance on, batch 1, none",
             "(c) maintenance on, batch 1, bridge", "(c) maintenance on, batch 4, none",
             "(c) maintenance on, batch 4, bridge", "(d) (c) + recall, 32 in index", "(d) (c) + recall, 32 in index"]
    assert len(lines) == len(names) and all(name in line for name, line in zip(names, lines))
    rows = [line.split() for line in lines]
    for row in rows:
        assert any(cell.endswith("x") for cell in row), row  # the ratio against generate
    for row in rows[2:]:
        shares = [float(cell[:-1]) for cell in row if cell.endswith("%")]
        extra = "bridge" in row or "recall," in row
        assert len(shares) == (4 if extra else 3), row  # apply, step4 (+ repair's or recall's extra), recall
        assert all(0 <= s <= 100 for s in shares[:2])
        assert (shares[-1] > 0) == ("recall," in row), "recall's own share only where recall runs"


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

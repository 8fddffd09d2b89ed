"""bench/kv_quant_search.py stays runnable, and its codecs do what the search's table says."""

import importlib.util
import sys
from pathlib import Path

import torch

from positronic.kv.formats import PACKED
from positronic.texts import DEFAULT_TEXT

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kv_quant_search", ROOT / "bench" / "kv_quant_search.py")
search = sys.modules["kv_quant_search"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(search)


def test_the_searchs_int4_row_is_todays_int4():
    x = torch.randn(2, 3, 17, 64) * torch.linspace(0.1, 5, 64)
    codec = PACKED["int4"]
    assert torch.equal(search.sym_int4(x), codec.decode(*codec.encode(x)))


def test_group_scales_bound_the_error_per_group():
    x = torch.randn(4, 64)
    x[:, 3] *= 50  # an outlier channel in the first group of 32
    err = (search.sym_int4(x, 32) - x).abs().view(4, 2, 32)
    scale = x.view(4, 2, 32).abs().amax(-1, keepdim=True) / 7
    assert (err <= scale / 2 * (1 + 1e-3)).all()
    assert err[:, 1].max() < err[:, 0].max() / 10, "the second group does not pay for the first's outlier"


def test_asymmetric_z4_keeps_zero_and_the_bound():
    x = torch.rand(8, 64) * 3 + 0.5  # all positive: the grid must still contain 0
    out = search.asym_int4(x, 32, "z4")
    lo, hi = torch.zeros(8, 2, 1), x.view(8, 2, 32).amax(-1, keepdim=True)
    assert ((out - x).abs().view(8, 2, 32) <= (hi - lo) / 15 / 2 * (1 + 1e-3)).all()
    assert torch.equal(search.asym_int4(torch.zeros(2, 64), 32, "z4"), torch.zeros(2, 64))
    clipped = search.asym_int4(x, 32, "z4", clips=search.CLIPS)
    assert (clipped - x).pow(2).sum() <= (out - x).pow(2).sum()


def test_hadamard_is_orthogonal_and_nf4_has_an_exact_zero():
    h = search.hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    assert len(search.NF4) == 16 and (search.NF4 == 0).any() and search.NF4.abs().max() == 1


def test_the_search_prints_its_table_on_a_tiny_model(run_script):
    out = run_script("kv_quant_search", "--model", "random:tiny",
                     "--text", str(DEFAULT_TEXT), "--offset", "0", "--tokens", "40",
                     "--only", "=int4-row (today)", "had-int4-row", check=True).stdout
    rows = {cells[1].strip(): cells for cells in (line.split("|") for line in out.splitlines() if line.startswith("| "))}
    assert rows["float"][3].strip() == "1.000" and rows["float"][5].strip() == "1.000"
    assert rows["int4-row (today)"][2].strip() == "4.250" and rows["int4-row (today)"][3].strip() == "0.266"
    assert "had-int4-row K, int4-row V" in rows

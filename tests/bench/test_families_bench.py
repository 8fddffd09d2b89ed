"""bench/families.py stays runnable: one row per model with every error column within float32
rounding, the maintained ticks' time, and the model's positions."""


def test_a_family_row_has_every_error_small_and_its_positions(run_script):
    out = run_script("families", "--model", "random:tiny", check=True).stdout
    (row,) = [line.split() for line in out.splitlines() if line.startswith("random:tiny")]
    assert row[1] == "LlamaForCausalLM"
    errors = [float(cell) for cell in row[2:7]]  # layer 0 K and V, decode, rebuild, attention row
    assert all(0 <= error < 1e-5 for error in errors), row
    assert float(row[7]) > 0 and int(row[8]) >= 0 and int(row[9]) == 512  # tick ms, rows rotated, positions

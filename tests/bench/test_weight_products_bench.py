"""bench/weight_products.py stays runnable: every product of a model's decode step per kernel, and
the int8-weight-only loop keeping a row's bits at every row count."""


def test_each_kernel_times_every_product_and_the_loop_keeps_a_rows_bits(run_script):
    out = run_script("weight_products", "--layers", "1", "--rows", "1", "3", "--repeats", "1", "--threads", "1",
                     "--kernels", "loop", "float32", check=True).stdout
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert [(row[0].strip(), int(row[1])) for row in rows] == [("loop", 1), ("loop", 3), ("float32", 1), ("float32", 3)]
    assert all(float(row[2]) > 0 for row in rows) and float(rows[0][3]) == 1.0
    assert rows[1][4].strip() == "same"  # a row among three: its bits alone


def test_settings_it_cannot_run_are_refused_before_anything_loads(run_script):
    done = run_script("weight_products", "--rows", "0", "2")
    assert done.returncode == 2 and "--rows must be >= 1, got 0" in done.stderr
    done = run_script("weight_products", "--kernels", "fast")
    assert done.returncode == 2 and "invalid choice: 'fast'" in done.stderr

"""bench/first_things.py stays runnable: one thing typed, judged and written to the table."""


def test_it_runs_a_thing_and_writes_the_table(run_script, tmp_path):
    out = run_script("first_things", "--only", "help", "--out", str(tmp_path / "t.md"), check=True).stdout
    assert "PASS python run.py --help" in out and "1 of 1 pass" in out
    table = (tmp_path / "t.md").read_text()
    assert "| pass | `python run.py --help" in table and "1 of 1 pass." in table

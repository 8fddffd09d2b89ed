"""bench/tick_host.py stays runnable: per policy, a tick under and past its budget split into
the model forward and the rest, and the costliest functions outside the model's modules."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_splits_each_policys_tick_into_the_forward_and_the_rest(run_script):
    out = run_script("tick_host", "--model", "random:tiny", "--budget", "48", "--ticks", "6",
                     "--rounds", "2", "--policies", "streaming", "smartkv+recall", "--profile", "5", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["streaming"], ["smartkv+recall"])
            and line.split()[1] in ("under", "past")]
    assert [(row[0], row[1]) for row in rows] == [("streaming", "under"), ("streaming", "past"),
                                                  ("smartkv+recall", "under"), ("smartkv+recall", "past")]
    for row in rows:
        tick, forward, outside = float(row[2]), float(row[3]), float(row[4])
        assert 0 < forward < tick and outside > 0
        assert row[7] == "-", "no GPU waits to count on a CPU"
    sections = out.split("cProfile, 6 ticks)")[1:]
    assert len(sections) == 4
    for section in sections:
        functions = [line.split()[-1] for line in section.strip().splitlines()[1:6]]
        assert len(functions) == 5 and not any("positronic/models/" in f for f in functions)
    assert "positronic/brain/loop.py:" in out  # the tick itself is the project's


def test_a_bad_policy_is_refused_before_any_model_loads(run_script):
    done = run_script("tick_host", "--policies", "streming")
    assert done.returncode == 2 and "--policies streming: a policy is one of" in done.stderr
    assert "model" not in done.stdout
    done = run_script("tick_host", "--model", "nosuch")
    assert done.returncode == 2 and "error: unknown model 'nosuch'" in done.stderr and "Traceback" not in done.stderr

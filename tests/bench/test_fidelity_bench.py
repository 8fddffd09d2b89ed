"""bench/fidelity.py stays runnable: the KL of the spliced cache's next-token distribution from a
fresh prefill's, with and without refreshes, at every measured tick; a refresh brings it to ~0."""


def test_fidelity_prints_the_kl_at_every_measured_tick_with_and_without_refresh(run_script):
    out = run_script("fidelity", "--model", "random:tiny", "--budget", "48", "--ticks", "60", "--every", "20",
                     "--refresh-every", "30", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["20"], ["40"], ["60"])]
    assert [row[0] for row in rows] == ["20", "40", "60"]
    for tick, plain, refreshed, repairs in rows:
        assert 0 <= float(plain) < 0.1 and 0 <= float(refreshed) < 0.1 and int(repairs) >= 0
    assert float(rows[-1][2]) < 1e-3, "refreshed at tick 30 and 60: the cache is a fresh prefill's again"
    assert "one refresh (prefill of" in out

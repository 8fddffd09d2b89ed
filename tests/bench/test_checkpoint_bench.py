"""bench/checkpoint.py stays runnable, and shows what it is for: a later checkpoint writes only
part of the session (the index blocks that changed and the cache file), not all of it."""

from pathlib import Path

import pytest

from positronic.smartkv.policy import SmartKVPolicy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.smollm2  # runs the embedded model (no `smol` fixture marks it)
def test_a_later_checkpoint_writes_only_part_of_the_session(run_script):
    # the embedded model: a random one's index blocks are too small to leave the mirror file (64 KiB)
    out = run_script("checkpoint", "--model", "smollm2", "--budget", "64", "--warm", "40",
                     "--requests", "2", "--tokens", "4", check=True).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["as"], ["full"])}
    running, full = rows["as"][3:], rows["full"][1:]  # tokens, first, later, each save..., wrote, dir, resume
    assert int(running[0]) > 0 and int(full[0]) == SmartKVPolicy.recall_capacity, "the index filled to capacity"
    (wrote, size), (wrote_full, size_full) = map(float, running[-3:-1]), map(float, full[-3:-1])
    assert 0 < wrote <= size, "one part-full block: it and the cache file are written again"
    assert 0 < wrote_full < size_full / 4, "32 blocks: the one new tokens fell in (and the cache file)"


def test_bad_arguments_are_refused_before_any_model_loads(run_script):
    done = run_script("checkpoint", "--requests", "0")
    assert done.returncode == 2 and "--requests, --tokens and --warm must be >= 1" in done.stderr
    done = run_script("checkpoint", "--model", "nosuch")
    assert done.returncode == 2 and "unknown model 'nosuch'" in done.stderr and "Traceback" not in done.stderr

"""Sessions (positronic/brain/session.py): what a saved run comes back as."""

import hashlib
import os
import re

import pytest
import safetensors.torch
import torch

from positronic import mirror
from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.state.readonly import MirrorView


def test_a_session_saved_before_the_new_settings_resumes_with_the_values_it_ran_with(tiny, tmp_path):
    """A session from before ttl_decay/ttl_gain/unit/bridge_margin existed has no such keys; it
    resumes with the values it ran with (DESIGN's ttl constants, pairs), not today's defaults:
    it goes on exactly as the same session saved with every key."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)),
                        BrainConfig(budget=48, repairer="self", ttl_gain=10.0, unit=2, seed=3))
    for _ in range(20):
        brain.step()
    sessions.save(tmp_path / "now", brain, tiny.name)
    path = sessions.save(tmp_path / "before", brain, tiny.name)
    saved, meta = mirror.load(path)
    for key in sessions.BEFORE_NEW_SETTINGS:
        del meta["config"][key]
    mirror.save(path, saved, meta)
    now, before = sessions.resume(tiny, tmp_path / "now"), sessions.resume(tiny, tmp_path / "before")
    assert (before.config.ttl_gain, before.config.unit, before.config.ttl_decay) == (10.0, 2, 2.0)
    assert before.config.ttl_gain != BrainConfig().ttl_gain, "not today's default"
    for _ in range(20):
        a, b = now.step(), before.step()
        assert (a.token_id, a.actions) == (b.token_id, b.actions)
    assert now.counts["repairs"] > 0


def test_a_save_clears_what_a_killed_save_left(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 20)), BrainConfig(budget=48))
    stale = [tmp_path / "mirror.msgpack.k3j9x.tmp",  # the temporary files of saves that were killed
             tmp_path / "kv-0123456789abcdef.safetensors.a8x.tmp", tmp_path / f"blob-{'0' * 64}.bin.q2z.tmp"]
    for path in stale:
        path.write_bytes(b"half a session")
    other = tmp_path / "notes.tmp"
    other.write_text("not ours")
    sessions.save(tmp_path, brain, tiny.name)
    assert not any(path.exists() for path in stale) and other.exists()
    assert sessions.resume(tiny, tmp_path).tick == 0


def saved_session(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 20)), BrainConfig(budget=48))
    path = sessions.save(tmp_path, brain, tiny.name)
    return path, *mirror.load(path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("budget"), "settings missing: ['budget']"),
    (lambda c: c.update(budget="64"), "setting budget has the wrong type: '64'"),
    (lambda c: c.update(temperature=None), "setting temperature has the wrong type"),
    (lambda c: c.update(policy="lru"), "unknown policy 'lru'"),
    (lambda c: c.update(score_layers=[1.5]), "setting score_layers has the wrong type"),
    (lambda c: c.update(colour="blue"), "unknown settings: ['colour']"),
    # the checks of a new config (BrainConfig.validate, check_budget): these resumed before
    (lambda c: c.update(refresh_kl=float("nan")), "setting refresh_kl must be a finite number >= 0, got nan"),
    (lambda c: c.update(budget=2**64 - 1), "setting budget must be in -2**63..2**63-1"),
    (lambda c: c.update(budget=600), "setting budget 600 is above random:tiny's 512 positions"),
    (lambda c: c.update(logit_bias="600:1.0"), "setting logit_bias names token ids [600] outside random:tiny's"),
])
def test_a_session_with_bad_settings_is_refused_with_one_clear_error(tiny, tmp_path, edit, message):
    path, saved, meta = saved_session(tiny, tmp_path)
    edit(meta["config"])
    mirror.save(path, saved, meta)
    before = path.read_bytes()
    with pytest.raises(sessions.SessionError, match=re.escape(message)):
        sessions.resume(tiny, tmp_path)
    assert path.read_bytes() == before, "a failed resume changes nothing"


def resealed_meta(edit):
    def corrupt(directory, tiny):
        path = directory / "mirror.msgpack"
        saved, meta = mirror.load(path)
        edit(meta)
        mirror.save(path, saved, meta)  # a valid checksum: the checks behind it must refuse
    return corrupt


def resealed_mirror(edit):
    def corrupt(directory, tiny):
        path = directory / "mirror.msgpack"
        saved, meta = mirror.load(path)
        edit(saved, tiny)
        mirror.write_atomic(path, mirror.to_bytes(saved, meta))
    return corrupt


def raw(edit):
    def corrupt(directory, tiny):
        path = directory / "mirror.msgpack"
        path.write_bytes(edit(path.read_bytes()))
    return corrupt


def cache_file(directory):
    (path,) = directory.glob("kv-*.safetensors")
    return path


def forged_cache(edit):
    """Tensors changed and saved with a matching sha256 in the (resealed) mirror file."""
    def corrupt(directory, tiny):
        tensors = safetensors.torch.load_file(cache_file(directory))
        edit(tensors)
        data = safetensors.torch.save(tensors)
        digest = hashlib.sha256(data).hexdigest()
        cache_file(directory).unlink()
        name = f"kv-{digest[:16]}.safetensors"
        (directory / name).write_bytes(data)
        resealed_meta(lambda meta: meta.update(cache={"file": name, "sha256": digest}))(directory, tiny)
    return corrupt


def swap_rows(saved, tiny):
    ids = saved.live.ledger_ids
    ids[5], ids[6] = ids[6], ids[5]


def set_token(token_id):
    def edit(saved, tiny):
        saved.ledger.entries[saved.live.ledger_ids[3]].token_id = token_id(tiny)
    return edit


def edit_live_text(data: bytes) -> bytes:
    """One live token's text changed in the file as it is, checksum untouched."""
    saved, _ = mirror.from_bytes(data)
    text = next(t for t in saved.live_texts()[4:] if t.isascii() and len(t) >= 1).encode()
    body = mirror.storage.msgpack.unpackb(data)["body"]
    at = data.index(body) + body.rindex(b"\xa1" + text if len(text) == 1 else text)  # its last copy in the text column
    at += len(text) == 1
    return data[:at] + (b"X" if text[:1] != b"X" else b"Y") + data[at + 1:]  # same length: only the checksum can tell


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    # settings are covered above; the rest of the metadata
    "negative tick": (resealed_meta(lambda m: m.update(tick=-3)), "tick -3 is not a count"),
    "huge tick": (resealed_meta(lambda m: m.update(tick=2**60)), "is not a count"),
    "tick as text": (resealed_meta(lambda m: m.update(tick="7")), "tick '7' is not a count"),
    "model missing": (resealed_meta(lambda m: m.pop("model")), "model missing"),
    "short sampler state": (resealed_meta(lambda m: m.update(generator=b"x" * 10)), "sampler state missing or of the wrong size"),
    "bad sampler state": (resealed_meta(lambda m: m.update(generator=b"\xff" * len(m["generator"]))), "sampler state invalid"),
    "negative count": (resealed_meta(lambda m: m["counts"].update(culls=-1)), "counts must map names to counts >= 0"),
    "policy state": (resealed_meta(lambda m: m.update(policy={"scorer": {"ids": [1]}})), "malformed saved state"),
    "cache path": (resealed_meta(lambda m: m["cache"].update(file="../../etc/passwd")), "cache reference malformed"),
    "pending input outside the vocabulary": (resealed_meta(lambda m: m.update(pending_input=[5, 512])),
                                             "pending input must be a list of token ids inside random:tiny's vocabulary"),
    "pending input negative": (resealed_meta(lambda m: m.update(pending_input=[-1])), "pending input must be a list"),
    "pending input as text": (resealed_meta(lambda m: m.update(pending_input="hello")), "pending input must be a list"),
    "pending input of floats": (resealed_meta(lambda m: m.update(pending_input=[5.0])), "pending input must be a list"),
    # the mirror, behind a valid checksum
    "swapped ledger ids": (resealed_mirror(swap_rows), "layer 0 differs from a fresh prefill"),
    "token outside the vocabulary": (resealed_mirror(set_token(lambda lm: lm.vocab_size + 5)), "outside random:tiny's vocabulary"),
    "token replaced": (resealed_mirror(set_token(lambda lm: 7)), "layer 0 differs"),
    "position beyond the model": (resealed_mirror(lambda s, lm: s.live.positions.__setitem__(-1, 10**6)), "beyond the model's limit 512"),
    "NaN brightness": (resealed_mirror(lambda s, lm: setattr(s.ledger.entries[2], "brightness", float("nan"))), "brightness nan"),
    # any edit without resealing
    "edited live text": (raw(edit_live_text), "checksum mismatch"),
    "truncated": (raw(lambda b: b[: len(b) // 2]), "not a readable mirror file"),
    # the cache file
    "cache damaged": (lambda d, lm: flip_last_byte(cache_file(d)), "checksum mismatch: the saved cache"),
    "cache missing": (lambda d, lm: cache_file(d).unlink(), "cannot read the saved cache"),
    "cache of another shape": (forged_cache(lambda t: t.update(keys=t["keys"][:, :, :-1].contiguous())), "saved tensor 'keys' is"),
    "cache of another dtype": (forged_cache(lambda t: t.update(values=t["values"].double())), "saved tensor 'values' is"),
    "cache with NaN": (forged_cache(lambda t: t["values"].view(-1).__setitem__(0, float("nan"))), "non-finite"),
    "cache with a layer-0 edit": (forged_cache(lambda t: t["keys"][0].add_(0.5)), "layer 0 differs"),
    "cache with an extra tensor": (forged_cache(lambda t: t.update(payload=torch.zeros(3))), "unknown saved tensors"),
    "cache too large": (forged_cache(lambda t: t.update(payload=torch.zeros(2**19))), "more than the"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_every_corruption_gives_one_clear_error_and_leaves_the_session_as_it_is(tiny, tmp_path, name):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48, policy="h2o"))
    for _ in range(25):
        brain.step()
    sessions.save(tmp_path, brain, tiny.name)
    corrupt, message = CORRUPTIONS[name]
    corrupt(tmp_path, tiny)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(sessions.SessionError, match=message) as info:
        sessions.resume(tiny, tmp_path)
    assert "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files, "a failed resume changes nothing"


STREAM_CONFIGS = {
    "brightness": BrainConfig(budget=48, seed=1),
    "h2o": BrainConfig(budget=48, policy="h2o", seed=2),
    "scored": BrainConfig(budget=48, policy="scored", seed=3),
    "bridge": BrainConfig(budget=48, repairer="bridge", seed=4),
    "knorm": BrainConfig(budget=48, policy="knorm", policy_options="mix=0.25", seed=5),  # a press's policy
}


def stream(brain, ticks):
    return [(r.token_id, r.actions) for r in (brain.step() for _ in range(ticks))]


@pytest.mark.parametrize("name", STREAM_CONFIGS)
def test_saving_does_not_change_the_run_and_a_resume_at_any_tick_goes_on_exactly(tiny, tmp_path, name):
    """The same tokens and edits with and without checkpoints, and after stopping at a tick off
    any save schedule and resuming from the files alone (the policy's own state included)."""
    prompt, config = [tiny.bos_id] + list(range(10, 40)), STREAM_CONFIGS[name]
    straight = stream(Brain.start(tiny, prompt, config), 60)
    saving, brain = [], Brain.start(tiny, prompt, config)
    for tick in range(60):
        saving += stream(brain, 1)
        if tick % 7 == 3:
            sessions.save(tmp_path / "every7", brain, tiny.name)
    assert saving == straight
    assert any(a["action"] != "add" for _, actions in straight for a in actions), "the run must edit"
    brain = Brain.start(tiny, prompt, config)
    first = stream(brain, 37)
    sessions.save(tmp_path / "stop37", brain, tiny.name)
    resumed = sessions.resume(tiny, tmp_path / "stop37")
    assert resumed.tick == 37
    assert first + stream(resumed, 23) == straight


def test_a_session_saved_without_a_cache_file_is_rebuilt_from_its_mirror(tiny, tmp_path):
    """Sessions from before the cache file were saved right after a rebuild: they resume by
    rebuilding, and a checksum-less version 1 mirror file is still read."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    stream(brain, 30)
    brain.state.rebuild(count=False)  # what the old save did
    path = sessions.save(tmp_path, brain, tiny.name)
    saved, meta = mirror.load(path)
    del meta["cache"], meta["policy"]
    columns = mirror.storage.to_columns(saved)
    path.write_bytes(mirror.storage.msgpack.packb({"format": "positronic-mirror", "version": 1, **columns,
                                                   "meta": meta}, use_bin_type=True))
    for old in tmp_path.glob("kv-*"):
        old.unlink()
    assert stream(sessions.resume(tiny, tmp_path), 20) == stream(brain, 20)


def test_a_save_killed_between_its_two_files_leaves_the_previous_checkpoint_whole(tiny, tmp_path, monkeypatch):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    stream(brain, 20)
    sessions.save(tmp_path, brain, tiny.name)
    after = stream(brain, 10)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the mirror file is never written: the new cache file is
    monkeypatch.setattr(MirrorView, "to_chunks", killed)
    with pytest.raises(KeyboardInterrupt):
        sessions.save(tmp_path, brain, tiny.name)
    monkeypatch.undo()
    assert len(list(tmp_path.glob("kv-*.safetensors"))) == 2
    resumed = sessions.resume(tiny, tmp_path)
    assert resumed.tick == 20 and stream(resumed, 10) == after
    sessions.save(tmp_path, resumed, tiny.name)
    assert len(list(tmp_path.glob("kv-*.safetensors"))) == 1, "the next save cleans up"


def test_a_session_saved_in_the_middle_of_a_typed_turn_resumes_with_the_rest_of_it(tiny, tmp_path):
    """The queue of typed tokens is part of the run's state: saved, resumed, and the resumed
    run goes on exactly as the uninterrupted one (the turn's rest, then the same generation)."""
    prompt, config = [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48, window=8, seed=6)
    brain = Brain.start(tiny, prompt, config)
    straight = stream(brain, 5)
    turn = brain.say("how are you?")
    straight += stream(brain, 60)
    brain = Brain.start(tiny, prompt, config)
    split = stream(brain, 5)
    assert brain.say("how are you?") == turn
    split += stream(brain, 10)
    assert brain.pending_input == tuple(turn[10:]), "saved with 10 of the turn's tokens fed"
    sessions.save(tmp_path, brain, tiny.name)
    assert mirror.load(tmp_path / "mirror.msgpack")[1]["pending_input"] == list(turn[10:])
    resumed = sessions.resume(tiny, tmp_path)
    assert resumed.pending_input == tuple(turn[10:])
    assert split + stream(resumed, 50) == straight
    assert [t for t, _ in straight[5:5 + len(turn)]] == turn
    sources = [e.source for e in resumed.state.mirror.ledger.entries]
    assert sources.count("user") == len(turn) and sources[-1] == "generated"


def test_a_session_from_before_typed_input_resumes_with_none_pending(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48, window=8))
    brain.say("queued")
    path = sessions.save(tmp_path, brain, tiny.name)
    saved, meta = mirror.load(path)
    del meta["pending_input"]
    mirror.save(path, saved, meta)
    assert sessions.resume(tiny, tmp_path).pending_input == ()


def test_an_old_session_whose_tokens_lie_outside_the_model_is_refused_not_crashed(tiny, tmp_path):
    """A cache-less (rebuilt-on-resume) session relabelled to a model with a smaller vocabulary:
    its token ids are checked before the rebuild feeds them to the embedding (an IndexError before)."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    stream(brain, 5)
    path = sessions.save(tmp_path, brain, tiny.name)
    saved, meta = mirror.load(path)
    del meta["cache"]
    columns = mirror.storage.to_columns(saved)
    columns["ledger"]["token_id"] = [600 + t for t in columns["ledger"]["token_id"]]  # beyond random:tiny's 512
    path.write_bytes(mirror.storage.msgpack.packb({"format": "positronic-mirror", "version": 1, **columns,
                                                   "meta": meta}, use_bin_type=True))
    with pytest.raises(sessions.SessionError, match="outside random:tiny's vocabulary"):
        sessions.resume(tiny, tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_mirror_file_that_is_not_a_regular_file_is_named_so_not_missing(tiny, tmp_path, kind):
    """A mirror.msgpack that is a FIFO, a directory or /dev/zero was reported "missing" (and a
    FIFO is never opened: that waits for a writer)."""
    path = tmp_path / sessions.MIRROR_FILE
    {"fifo": lambda: os.mkfifo(path), "directory": path.mkdir, "device": lambda: path.symlink_to("/dev/zero")}[kind]()
    with pytest.raises(sessions.SessionError, match="mirror.msgpack: not a regular file"):
        sessions.resume(tiny, tmp_path)
    with pytest.raises(sessions.SessionError, match=r"no saved session \(mirror.msgpack missing\)"):
        sessions.resume(tiny, tmp_path / "elsewhere")


def test_a_cache_file_that_is_a_device_is_refused_without_reading_it(tiny, tmp_path):
    """A kv-*.safetensors symlinked to /dev/zero states size 0: what is opened is checked (a
    regular file, at most the bytes the context can need), never read until memory runs out."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    sessions.save(tmp_path, brain, tiny.name)
    cache = next(tmp_path.glob("kv-*.safetensors"))
    cache.unlink()
    cache.symlink_to("/dev/zero")
    with pytest.raises(sessions.SessionError, match="not a regular file"):
        sessions.resume(tiny, tmp_path)


def test_a_run_id_names_the_run_in_its_session_and_survives_resumes(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    other = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=48))
    assert re.fullmatch(r"[0-9a-f]{32}", brain.run_id) and brain.run_id != other.run_id
    sessions.save(tmp_path, brain, tiny.name)
    assert sessions.resume(tiny, tmp_path).run_id == brain.run_id


def test_one_process_at_a_time_holds_a_session_directory(tmp_path):
    with sessions.locked(tmp_path / "s", "run.py"):
        with pytest.raises(sessions.SessionLocked, match=r"in use by run.py \(pid \d+\)"):
            with sessions.locked(tmp_path / "s"):
                pass
    with sessions.locked(tmp_path / "s"):  # released with its holder
        pass


def test_a_second_claim_in_the_same_process_is_refused_too(tmp_path):
    """flock belongs to the open file, not the process: a server's pool, or a test holding a
    session beside an in-process run, is refused as another process would be."""
    first = sessions.Claim(tmp_path / "s", "positronic serve")
    with pytest.raises(sessions.SessionLocked) as refused:
        sessions.Claim(tmp_path / "s", "run.py")
    assert refused.value.holder == f"positronic serve (pid {os.getpid()})"
    assert (tmp_path / "s" / sessions.LOCK_FILE).read_text() == f"positronic serve (pid {os.getpid()})\n"
    first.release()
    first.release()  # once; the second does nothing
    sessions.Claim(tmp_path / "s", "run.py").release()


def test_a_claim_let_go_leaves_no_lock_file_and_removes_only_the_empty_directories_it_made(tmp_path):
    """A run refused after its claim (a bad setting found once the model has loaded) leaves
    nothing behind; a directory that holds a checkpoint, or existed before, stays."""
    with sessions.locked(tmp_path / "a" / "b" / "c", "run.py") as directory:
        assert {p.name for p in directory.iterdir()} == {sessions.LOCK_FILE}
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes").write_text("the user's")
    with sessions.locked(tmp_path / "mine"):
        pass
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes"]
    with sessions.locked(tmp_path / "new" / "s") as directory:
        (directory / sessions.MIRROR_FILE).write_bytes(b"a checkpoint")
    assert [p.name for p in (tmp_path / "new" / "s").iterdir()] == [sessions.MIRROR_FILE]


@pytest.mark.parametrize("kind", ["symlink", "hard link", "directory"])
def test_a_lock_file_that_is_not_a_plain_file_of_its_own_is_refused_and_nothing_is_written_through_it(tmp_path, kind):
    """The lock file is truncated and written when claimed: a link planted in its place would
    have that write land on the file it names."""
    target = tmp_path / "precious"
    target.write_text("keep me")
    session = tmp_path / "s"
    session.mkdir()
    lock = session / sessions.LOCK_FILE
    if kind == "symlink":
        lock.symlink_to(target)
    elif kind == "hard link":
        os.link(target, lock)
    else:
        lock.mkdir()
    with pytest.raises(sessions.SessionError, match=re.escape(str(lock)) + ".*remove it"):
        with sessions.locked(session, "run.py"):
            pass
    assert target.read_text() == "keep me"
    assert lock.is_symlink() or lock.exists(), "what was there is left as it was"

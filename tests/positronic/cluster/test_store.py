"""Sessions in an object store (positronic/cluster/store.py), on fsspec's local file system as the
store (a file:// URL, as a replica would reach s3:// or gs://): a real session's checkpoint pushed
and pulled whole, only new files uploaded, and one replica per session by its lease."""

import time

import pytest

from positronic.brain import session as sessions
from positronic.brain.loop import Brain, BrainConfig
from positronic.cluster.store import LEASE, MIRROR, Held, SessionStore

CONFIG = BrainConfig(policy="h2o", budget=48, temperature=0.0, seed=0)


def brain_after(tiny, ticks: int) -> Brain:
    brain = Brain.start(tiny, tiny.tokenizer.encode("the store keeps every session whole"), CONFIG)
    for _ in range(ticks):
        brain.step()
    return brain


def listing(path) -> set[str]:
    return {p.name for p in path.iterdir()} - {LEASE, ".lock"} if path.exists() else set()


def test_a_checkpoint_pushed_by_one_replica_resumes_on_another_exactly(tiny, tmp_path):
    url = f"file://{tmp_path / 'store'}"
    a = SessionStore(url, tmp_path / "a", holder="replica-0:1")
    b = SessionStore(url, tmp_path / "b", holder="replica-1:2")
    brain = brain_after(tiny, 50)  # past its budget: rows culled
    sessions.save(tmp_path / "a" / "s", brain, tiny.name)
    assert a.push("s")
    assert listing(tmp_path / "store" / "s") == listing(tmp_path / "a" / "s")
    b.pull("s")
    for name in listing(tmp_path / "a" / "s"):
        assert (tmp_path / "b" / "s" / name).read_bytes() == (tmp_path / "a" / "s" / name).read_bytes()
    resumed = sessions.resume(tiny, tmp_path / "b" / "s")
    expected = [brain.step().token_id for _ in range(10)]
    assert [resumed.step().token_id for _ in range(10)] == expected


def test_a_push_uploads_only_new_files_and_drops_what_the_mirror_no_longer_names(tiny, tmp_path, monkeypatch):
    store = SessionStore(f"file://{tmp_path / 'store'}", tmp_path / "a", holder="replica-0:1")
    brain = brain_after(tiny, 5)
    sessions.save(tmp_path / "a" / "s", brain, tiny.name)
    store.push("s")
    first = listing(tmp_path / "store" / "s")
    brain.step()
    sessions.save(tmp_path / "a" / "s", brain, tiny.name)  # a new cache file; the old one removed locally
    uploaded = []
    put = store.fs.put_file
    monkeypatch.setattr(store.fs, "put_file", lambda local, remote, **k: (uploaded.append(remote), put(local, remote, **k)))
    store.push("s")
    assert listing(tmp_path / "store" / "s") == listing(tmp_path / "a" / "s") != first
    assert [u.rsplit("/", 1)[-1] for u in uploaded] == sorted(listing(tmp_path / "a" / "s") - first - {MIRROR})
    assert not any(name.endswith(".tmp") for name in listing(tmp_path / "store" / "s"))


def test_a_pull_of_a_session_the_store_lacks_leaves_nothing_to_resume(tiny, tmp_path):
    store = SessionStore(f"file://{tmp_path / 'store'}", tmp_path / "a", holder="replica-0:1")
    sessions.save(tmp_path / "a" / "s", brain_after(tiny, 3), tiny.name)  # a stale local copy
    store.pull("s")  # the store has none: the session starts fresh here
    assert not (tmp_path / "a" / "s" / MIRROR).exists()
    assert store.push("s") is False


def test_one_replica_holds_a_session_until_it_releases_dies_or_is_taken_over(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    a = SessionStore(url, tmp_path / "a", holder="replica-0:1", lease_s=0.5)
    b = SessionStore(url, tmp_path / "b", holder="replica-1:2", lease_s=0.5)
    a.claim("s")
    a.claim("s")  # its own lease: claimed again
    with pytest.raises(Held, match="session s is in use by replica-0:1"):
        b.claim("s")
    with pytest.raises(Held):
        b.claim("s", takeover=["replica-1", "replica-2"])  # a takeover names the replicas seen dead, not any
    b.release("s")  # not b's: left as it is
    assert a.lease("s")["holder"] == "replica-0:1"
    b.claim("s", takeover=["replica-0", "replica-2"])  # the front saw replica-0 die: its lease is taken at once
    assert a.lease("s")["holder"] == "replica-1:2"
    with pytest.raises(Held):
        a.claim("s")
    time.sleep(0.6)  # replica-1 died too: its lease runs out
    a.claim("s")
    a.release("s")
    assert a.lease("s") is None
    b.claim("s")
    # replica-1's process died and Ray started it again (another pid): the new one takes its lease
    again = SessionStore(url, tmp_path / "b2", holder="replica-1:3", lease_s=0.5)
    again.claim("s")
    assert again.lease("s")["holder"] == "replica-1:3"


def test_a_torn_lease_file_is_nobodys(tmp_path):
    store = SessionStore(f"file://{tmp_path / 'store'}", tmp_path / "a", holder="replica-0:1")
    (tmp_path / "store" / "s").mkdir(parents=True)
    (tmp_path / "store" / "s" / LEASE).write_bytes(b'{"holder": "replica-9:')
    store.claim("s")
    assert store.lease("s")["holder"] == "replica-0:1"


def test_a_replica_on_a_store_claims_pulls_pushes_and_releases_its_sessions(tiny, tmp_path, live_server,
                                                                             server_settings, monkeypatch):
    """StoreSync around a real server (in this process, no Ray): each answer's checkpoint is in the
    store when the answer ends, a session another replica holds is refused and left alone, a push
    that fails is counted while the answer still goes, and shutdown pushes and releases all."""
    from positronic.cluster.store import StoreSync

    url = f"file://{tmp_path / 'store'}"
    other = SessionStore(url, tmp_path / "other", holder="replica-1:9", lease_s=60)
    other.claim("theirs")
    server = live_server(tiny, server_settings(tmp_path / "work"), CONFIG)
    store = SessionStore(url, server.server.settings.session_dir, holder="replica-0:1", lease_s=60)
    server.uvicorn.config.app = StoreSync(server.app, store, server.server)
    body = {"model": tiny.name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    with server:
        answer = server.post("/v1/completions", {**body, "user": "mine"})
        assert answer.status_code == 200, answer.text
        remote = tmp_path / "store" / "mine"
        local = server.server.settings.session_dir / "mine"
        assert (remote / MIRROR).read_bytes() == (local / MIRROR).read_bytes()  # pushed before the answer ended
        assert store.lease("mine")["holder"] == "replica-0:1"
        streamed = server.post("/v1/completions", {**body, "user": "mine", "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert (remote / MIRROR).read_bytes() == (local / MIRROR).read_bytes()

        refused = server.post("/v1/completions", {**body, "user": "theirs"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_in_use"
        assert "replica-1:9" in refused.json()["error"]["message"]
        assert other.lease("theirs")["holder"] == "replica-1:9" and not (tmp_path / "store" / "theirs" / MIRROR).exists()

        monkeypatch.setattr(store, "push", lambda session: (_ for _ in ()).throw(OSError("No space left on device")))
        kept = (remote / MIRROR).read_bytes()
        answer = server.post("/v1/completions", {**body, "user": "mine"})
        assert answer.status_code == 200  # the answer goes; the failure is counted
        assert "positronic_session_store_push_failures_total 1.0" in server.get("/metrics").text
        assert (remote / MIRROR).read_bytes() == kept  # the store keeps the previous checkpoint, whole
        monkeypatch.undo()
    # shut down: every session pushed (the one that failed too) and its lease released
    assert (remote / MIRROR).read_bytes() == (local / MIRROR).read_bytes() != kept
    assert store.lease("mine") is None

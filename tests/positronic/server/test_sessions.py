"""The server's sessions (positronic/server/pool.py, conversation.py, worker.py, turn.py): a
pool of at most max_sessions in memory, the least recently used checkpointed to disk and resumed
exactly, idle ones freed."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from positronic.batch import offload
from positronic.brain import session as brain_session
from positronic.brain.loop import Brain
from positronic.server.conversation import Conversation, describe
from positronic.server.pool import PoolFull, SessionInUse, SessionPool, SessionUnusable
from positronic.server.rules import check_session_id
from positronic.server.worker import ModelWorker

ROOT = Path(__file__).resolve().parents[3]


def test_a_session_outlives_max_sessions_and_resumes_from_disk(tiny, live, tmp_path, live_server, server_settings, chat, conversation, metric):
    """With room for two sessions, a third checkpoints the least recently used one to disk;
    it comes back on its next request, and after a restart, and says what it would have said
    had it stayed in memory (the module's server, with room to spare, is the reference)."""
    texts = ["first words", "second words", "third words", "fourth words"]
    reference = conversation(live.client(), "ref-resume", texts)
    small = server_settings(tmp_path, max_sessions=2, checkpoint_each_request=False)  # saved only to make room
    with live_server(tiny, small) as server:
        client = server.client()
        history = []

        def say(text):
            content = chat(client, "s1", text, history=history).choices[0].message.content
            history.extend([{"role": "user", "content": text}, {"role": "assistant", "content": content}])
            return content

        replies = [say(texts[0])]
        chat(client, "s2", "another")
        assert not (small.session_dir / "s1" / "mirror.msgpack").exists()  # held (its lock file), not saved
        chat(client, "s3", "and another")  # no room: s1 goes to disk
        assert (small.session_dir / "s1" / "mirror.msgpack").exists()
        assert "s1" not in server.server.pool.loaded
        replies.append(say(texts[1]))  # back from disk (s2 goes)
        assert "s1" in server.server.pool.loaded and (small.session_dir / "s2").exists()
        replies.append(say(texts[2]))
        metrics = server.get("/metrics").text
        assert metric(metrics, "positronic_sessions_resumed_total") == 1
        assert metric(metrics, "positronic_sessions_saved_total") == 2
        live_sessions = server.get("/health").json()["sessions"]
        assert live_sessions["in_memory"] <= 2
    assert (small.session_dir / "s3").exists()  # the shutdown saved the sessions in memory
    with live_server(tiny, small) as server:  # a restart: s1 resumes from its shutdown checkpoint
        client = server.client()
        replies.append(say(texts[3]))
    assert replies == reference


def test_idle_sessions_are_checkpointed_and_freed(tiny, tmp_path, live_server, server_settings, chat):
    idle = server_settings(tmp_path, idle_save_s=0.2, sweep_every_s=0.05)
    with live_server(tiny, idle) as server:
        chat(server.client(), "sleepy", "zzz")
        deadline = time.monotonic() + 10
        while server.get("/health").json()["sessions"]["in_memory"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.get("/health").json()["sessions"]["in_memory"] == 0
        assert (idle.session_dir / "sleepy" / "mirror.msgpack").exists()
        assert server.get("/v1/sessions/sleepy").json()["transcript"].startswith("<s>\nUser: zzz")


@pytest.mark.parametrize("good", ["a", "Z9", "my_session-1", "x" * 64])
def test_a_session_id_names_a_directory_safely(good):
    assert check_session_id(good) == good


@pytest.mark.parametrize("bad", ["", "x" * 65, "../etc", "a/b", "a b", "ä", ".", "a\n"])
def test_a_session_id_that_could_escape_its_directory_is_refused(bad):
    with pytest.raises(ValueError, match="must be 1 to 64 characters"):
        check_session_id(bad)


def test_the_pool_checkpoints_the_least_recently_used_session_and_resumes_it_exactly(tiny, tmp_path, server_config,
                                                                                     monkeypatch):
    """The pool on its own (no HTTP): room for one session; a second one checkpoints the first,
    a third while the second is held is PoolFull, and the first comes back as it was. Its files
    are written and read in a helper thread, not the forward thread (its rounds go on)."""
    disk = []
    for name in ("save", "read"):
        real = getattr(brain_session, name)

        def spied(*args, real=real, name=name, **kwargs):
            disk.append((name, threading.current_thread().name))
            return real(*args, **kwargs)

        monkeypatch.setattr(brain_session, name, spied)

    async def scenario():
        worker = ModelWorker()
        pool = SessionPool(tiny, worker, tmp_path, max_sessions=1)
        try:
            first = await pool.acquire("first")
            await worker.run(first.start, tiny, [tiny.bos_id] + tiny.encode("hello"), server_config)
            for _ in range(5):
                await worker.run(first.step, {})
            before = await worker.run(first.describe)
            pool.release(first)
            second = await pool.acquire("second")  # no room: "first" goes to disk
            assert set(pool.loaded) == {"second"} and (pool.saved, pool.freed) == (1, 1)
            assert first.evicted and (tmp_path / "first" / "mirror.msgpack").exists()
            assert await pool.describe("first") == before, "described from its checkpoint"
            with pytest.raises(PoolFull, match="all 1 sessions are in use"):
                await pool.acquire("third")
            with pytest.raises(PoolFull):
                await pool.acquire(None)
            pool.release(second)  # never started: nothing to save
            again = await pool.acquire("first")
            assert pool.resumed == 1 and pool.saved == 1 and again is not first
            assert await worker.run(again.describe) == before
            assert [name for name, _ in disk] == ["save", "read"]
            assert all(thread.startswith("positronic-aside") for _, thread in disk), disk
            pool.release(again)
            assert await pool.describe("nobody") is None
            (tmp_path / "broken").mkdir()
            (tmp_path / "broken" / "mirror.msgpack").write_bytes(b"not a mirror")
            with pytest.raises(SessionUnusable, match="session broken cannot be resumed"):
                await pool.acquire("broken")
        finally:
            worker.close()

    asyncio.run(scenario())


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_the_pool_holds_the_sessions_it_has_and_is_refused_one_another_holds(tiny, tmp_path, server_config):
    """A session in the pool is held (brain/session.py Claim) from its admission to its
    eviction; one that another holds is refused with SessionInUse naming the holder, before
    any slot is freed for it, and nothing on disk changes."""
    async def scenario():
        worker = ModelWorker()
        pool = SessionPool(tiny, worker, tmp_path, max_sessions=1)
        try:
            bob = await pool.acquire("bob")
            await worker.run(bob.start, tiny, [tiny.bos_id] + tiny.encode("hello"), server_config)
            pool.release(bob)
            with pytest.raises(brain_session.SessionLocked, match=rf"in use by positronic serve \(pid {os.getpid()}\)"):
                brain_session.Claim(tmp_path / "bob", "run.py")  # idle, but in the pool
            run = brain_session.Claim(tmp_path / "alice", "run.py")
            before = {name: files(tmp_path / name) for name in ("alice", "bob")}
            with pytest.raises(SessionInUse, match=rf"session alice is in use by run.py \(pid {os.getpid()}\)"):
                await pool.acquire("alice")
            assert set(pool.loaded) == {"bob"} and pool.saved == 0, "no slot was freed for it"
            assert {name: files(tmp_path / name) for name in ("alice", "bob")} == before
            run.release()
            alice = await pool.acquire("alice")  # now it comes in, and bob goes to disk and is let go
            assert (tmp_path / "bob" / brain_session.MIRROR_FILE).exists()
            brain_session.Claim(tmp_path / "bob", "run.py").release()
            pool.release(alice)
            await pool.close()
            brain_session.Claim(tmp_path / "bob", "run.py").release()
            assert not (tmp_path / "alice").exists(), "never started: nothing saved, and its lock went with it"
        finally:
            worker.close()

    asyncio.run(scenario())


def test_run_py_is_refused_a_session_the_server_holds_and_takes_it_once_the_server_let_it_go(
        tiny, tmp_path, live_server, server_settings, chat, run_cli, capsys):
    """The race that lost a run's ticks: `run.py --session SD/alice --resume` beside a server
    holding alice ran, and the server's next checkpoint wrote over what it saved. Now it is
    refused with one line naming the server, and changes nothing."""
    settings = server_settings(tmp_path)
    alice = settings.session_dir / "alice"
    run = ("-m", "random:tiny", "--no-tui", "--no-input", "-n", "3", "--session", str(alice), "--resume")
    with live_server(tiny, settings) as server:
        first = chat(server.client(), "alice", "hello")
        before = files(alice)
        capsys.readouterr()
        assert run_cli(*run) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{alice} is in use by positronic serve (pid {os.getpid()})" in err, err
        assert files(alice) == before
        history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.choices[0].message.content}]
        chat(server.client(), "alice", "more", history=history)  # the server goes on with it
    tick = brain_session.load(alice)[1]["tick"]  # its shutdown checkpoint; the server let it go
    assert run_cli(*run) == 0
    assert brain_session.load(alice)[1]["tick"] == tick + 3
    assert brain_session.LOCK_FILE not in files(alice)


def test_the_server_is_refused_a_session_run_py_holds_and_changes_nothing(tiny, tmp_path, live_server,
                                                                           server_settings, chat):
    """The other way round: the server answered (200, checkpointed) a session a running
    `run.py` held, and the run's final save wrote over that turn. Now the request gets 409
    `session_in_use` naming the run, the server frees no slot for it and writes nothing; once
    the run has ended, the session's next request goes on from the run's last tick."""
    settings = server_settings(tmp_path, max_sessions=1)
    alice = settings.session_dir / "alice"
    request = {"model": "random:tiny", "prompt": " and then", "max_tokens": 4, "user": "alice"}
    with live_server(tiny, settings) as server:
        chat(server.client(), "bob", "hello")  # holds the only slot
        run = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "-m", "random:tiny", "--no-tui", "--no-input",
                                "-n", "-1", "-c", "64", "--save-every", "1000000", "--session", str(alice)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            holder, deadline = f"run.py (pid {run.pid})", time.monotonic() + 60
            while not (alice / brain_session.LOCK_FILE).exists() or holder not in (alice / brain_session.LOCK_FILE).read_text():
                assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
                time.sleep(0.01)
            refused = server.post("/v1/completions", request)
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "user", "session_in_use")
            assert error["message"].startswith(f"session alice is in use by {holder}"), error
            assert run.poll() is None, "the run held it all along"
            assert list(files(alice)) == [brain_session.LOCK_FILE], "the server wrote nothing"
            assert set(server.server.pool.loaded) == {"bob"}, "no slot was freed for it"
            for line in run.stderr:  # ticking (a progress line): a SIGTERM now ends it with a checkpoint
                if line.startswith("["):
                    break
            run.send_signal(signal.SIGTERM)
            assert run.wait(timeout=60) == 128 + signal.SIGTERM, run.stderr.read()
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        tick = brain_session.load(alice)[1]["tick"]
        answered = server.post("/v1/completions", request)
        assert answered.status_code == 200, answered.text
        assert answered.json()["positronic"]["tick"] > tick


def test_a_session_writing_its_checkpoint_holds_up_no_other_session(tiny, tmp_path, server_config, monkeypatch):
    """A checkpoint makes no forward: while one session's is being written (held here until
    the other session has ticked 4 times), the other's ticks go on without waiting for it."""
    others_ticked, real_save = threading.Event(), brain_session.save

    def slow_save(*args, **kwargs):
        assert others_ticked.wait(30), "the other session's ticks waited for the checkpoint being written"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(brain_session, "save", slow_save)

    async def scenario():
        worker = ModelWorker()
        saving, ticking = Conversation("saving"), Conversation("ticking")
        try:
            for conversation, text in ((saving, "hello"), (ticking, "good morning")):
                await worker.run(conversation.start, tiny, [tiny.bos_id] + tiny.encode(text), server_config)
            save = asyncio.ensure_future(worker.run(saving.save, tmp_path / "saving", tiny.name, owner=saving))
            for _ in range(4):
                await worker.run(ticking.step, {}, owner=ticking)
            others_ticked.set()
            await save
        finally:
            worker.close()
        assert (tmp_path / "saving" / "mirror.msgpack").exists() and not saving.dirty

    asyncio.run(scenario())


def test_a_request_waits_for_its_own_sessions_job_left_running_and_for_no_other_sessions(tiny, tmp_path,
                                                                                        server_config):
    """A job a cancelled request left running (held here on an event) keeps the next request of
    its session out of the brain until it ends; a request of another session is let in at once.
    (It used to wait for every job in flight: ~70 ms a request at 8 clients, bench/results/history/batch.md.)"""
    release = threading.Event()

    def left_running() -> str:  # a job waits without holding up the forward thread (as a checkpoint's write)
        assert offload(release.wait, 30), "the test never let the job end"
        return "done"

    async def scenario():
        worker = ModelWorker()
        pool = SessionPool(tiny, worker, tmp_path, max_sessions=2)
        try:
            busy = await pool.acquire("busy")
            await worker.run(busy.start, tiny, [tiny.bos_id] + tiny.encode("hello"), server_config, owner=busy)
            job = asyncio.ensure_future(worker.run(left_running, owner=busy))
            await asyncio.sleep(0.05)
            pool.release(busy)  # its request went away; the job runs on
            other = await asyncio.wait_for(pool.acquire("other"), timeout=10)  # not behind busy's job
            assert not job.done()
            again = asyncio.ensure_future(pool.acquire("busy"))
            await asyncio.sleep(0.2)
            assert not again.done(), "the session's next request got in while its earlier job was running"
            release.set()
            assert await asyncio.wait_for(again, timeout=10) is busy and await job == "done"
            pool.release(busy), pool.release(other)
        finally:
            release.set()
            worker.close()

    asyncio.run(scenario())


def test_describe_says_what_was_said_and_what_the_brain_holds(tiny, server_config):
    brain = Brain.start(tiny, [tiny.bos_id] + tiny.encode("ab"), server_config)
    brain.say("cd")
    for _ in range(6):
        brain.step()
    mirror = brain.state.mirror
    described = describe(mirror, brain.tick, 96)
    said = [e for e in mirror.ledger.entries if e.source in ("prompt", "user", "generated")]
    assert [e.source for e in said][:3] == ["prompt"] * 3 and "user" in [e.source for e in said]
    assert described["transcript"] == "".join(e.text for e in said) and described["transcript"].startswith("<s>ab")
    assert described["transcript_tokens"] == len(said) == 9
    assert described["live_text"] == "".join(mirror.live_texts()) and described["live_length"] == len(mirror)
    assert (described["tick"], described["budget"], described["ledger_tokens"]) == (6, 96, len(mirror.ledger))


def test_a_requests_reply_is_one_job_and_stops_before_its_next_tick_once_nobody_listens(tiny, server_config):
    """A request reads its input and generates its reply in one worker job (a thread per token
    made each round wait for the event loop to start the next job): the tokens are those of the
    same brain stepped directly. A reader of the session gets in between two of its ticks. A
    consumer that stops listening (a client gone) stops the job before its next tick."""
    from positronic.server.turn import Turn

    async def reply(worker, conversation, max_tokens, *, leave_after=None):
        """The turn, and its reply's length when its consumer stopped listening (None: never)."""
        turn = Turn(conversation, worker, tiny, max_tokens=max_tokens, ignore_eos=True)
        pieces = turn.pieces()
        count = 0
        async for _ in pieces:
            count += 1
            if count == leave_after:
                # a reader between two of its ticks (GET /v1/sessions/ID) does not wait for the reply's end
                state = await asyncio.wait_for(worker.run(conversation.between_ticks, conversation.describe), 30)
                assert state["tick"] >= count and not turn.reply.done
                await pieces.aclose()
                return turn, len(turn.reply.ids)
        return turn, None

    async def scenario():
        worker, jobs = ModelWorker(), []
        run = worker.run

        async def counted(fn, *args, **kwargs):
            jobs.append(fn)
            return await run(fn, *args, **kwargs)

        worker.run = counted
        listened, alone = Conversation("listened"), Conversation("alone")
        try:
            for conversation in (listened, alone):
                await run(conversation.start, tiny, [tiny.bos_id] + tiny.encode("hello there"), server_config)
                conversation.queue(tiny.encode(" and more"))  # input to read first, as a completion's prompt
            whole, _ = await reply(worker, listened, 12)
            assert len(jobs) == 1, f"{len(jobs)} jobs for one request"
            expected = [(await run(alone.read_one)) for _ in range(len(tiny.encode(" and more")))]
            assert all(record is not None for record in expected) and not alone.reading
            expected = [(await run(alone.step, {})).token_id for _ in range(12)]
            assert whole.reply.ids == expected and whole.reply.done

            left, length = await reply(worker, listened, 4000, leave_after=2)
            # the session's next request, begun at once, waits for that job; once it ticks, readers
            # still find it ticking (the earlier job's end does not take its entry away)
            again = Turn(listened, worker, tiny, max_tokens=4000, ignore_eos=True).pieces()
            await again.__anext__()
            assert len(left.reply.ids) - length <= 1, "the job went on ticking after its consumer left"
            assert not left.reply.done and len(left.reply.ids) < 4000
            assert id(listened) in worker.ticking
            await again.aclose()
            await asyncio.wait_for(worker.settled(listened), timeout=30)  # the job ends by itself
            assert id(listened) not in worker.ticking
        finally:  # bounded: a job deadlocked by a reader that did not step aside must fail the test, not hang it
            closing = threading.Thread(target=worker.close, daemon=True)
            closing.start()
            closing.join(30)
            assert not closing.is_alive(), "the worker's jobs never ended"

    asyncio.run(scenario())

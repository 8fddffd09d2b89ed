"""A session that cannot be checkpointed (its directory unwritable, the disk full) is said, not
hidden: the failure is logged with the session and the file, counted in
positronic_session_save_failures_total, a request that needed its slot gets a 507 in OpenAI's
error shape (not an endless 429), and the shutdown reports the lost sessions, so `serve` exits 1.

Tests run as root, where a read-only directory is still written: the unwritable directory is a
path under a regular file.
"""

import asyncio
import logging
import shutil
import signal
from pathlib import Path

import openai
import pytest

from positronic.server.app import exit_status
from positronic.server.pool import PoolFull, SaveFailed, SessionPool
from positronic.server.worker import ModelWorker

MODEL = "random:tiny"


def unwritable(tmp_path: Path) -> Path:
    """A session directory no save can create: its parent is a regular file."""
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path / "a-file" / "sessions"


def test_the_pool_says_a_session_it_cannot_save_and_keeps_it(tiny, tmp_path, server_config, caplog):
    directory = unwritable(tmp_path)

    async def scenario():
        worker = ModelWorker()
        pool = SessionPool(tiny, worker, directory, max_sessions=1)
        try:
            first = await pool.acquire("first")
            await worker.run(first.start, tiny, [tiny.bos_id] + tiny.encode("hello"), server_config)
            await worker.run(first.step, {})
            pool.release(first)
            with caplog.at_level(logging.ERROR, logger="positronic.server.app"):
                with pytest.raises(SaveFailed, match="session first: NotADirectoryError"):
                    await pool.acquire("second")  # the slot "first" holds cannot be freed
            assert not isinstance(SaveFailed(), PoolFull)
            assert pool.save_failures == 1 and set(pool.unsaved) == {"first"}
            assert set(pool.loaded) == {"first"} and pool.in_use == 1  # kept in memory, nothing lost yet
            failure = [r.getMessage() for r in caplog.records if "could not be checkpointed" in r.getMessage()]
            assert failure and "session first" in failure[0]
            assert str(directory / "first" / "mirror.msgpack") in failure[0]
            # the storage comes back: the next request frees the slot and the session is saved
            (tmp_path / "a-file").unlink()
            second = await pool.acquire("second")
            assert (directory / "first" / "mirror.msgpack").exists() and pool.unsaved == {}
            pool.release(second)
            # and goes away again: close() says which sessions it lost
            again = await pool.acquire("first")
            await worker.run(again.step, {})
            pool.release(again)
            shutil.rmtree(directory.parent)
            (tmp_path / "a-file").write_text("not a directory")
            saved, lost = await pool.close()
            assert saved == 0 and set(lost) == {"first"} and "NotADirectoryError" in lost["first"]
            assert pool.save_failures == 2
        finally:
            worker.close()

    asyncio.run(scenario())


def test_a_request_whose_slot_cannot_be_freed_gets_507_and_the_shutdown_reports_it(
        tiny, tmp_path, live_server, server_settings, metric, caplog):
    settings = server_settings(tmp_path, max_sessions=1)
    settings.session_dir = unwritable(tmp_path)
    with caplog.at_level(logging.ERROR, logger="positronic.server.app"):
        with live_server(tiny, settings) as server:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            kept = server.post("/v1/completions", {**body, "user": "keeper"})
            # answered (the reply is whole), and told that the session's checkpoint does not hold it
            assert kept.status_code == 200 and kept.json()["positronic"]["checkpointed"] is False
            for _ in range(2):  # each request tries again, and each is told why
                refused = server.post("/v1/completions", {**body, "user": "other"})
                assert refused.status_code == 507, refused.text
                error = refused.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert (error["type"], error["code"]) == ("server_error", "session_save_failed")
                assert "session keeper" in error["message"] and "checkpointed" in error["message"]
            # the write-through at the end of keeper's request, then one per refused request
            assert metric(server.get("/metrics").text, "positronic_session_save_failures_total") == 3
            assert server.get("/health").json()["sessions"]["unsaved"] == ["keeper"]
            assert server.post("/v1/completions", {**body, "user": "keeper"}).status_code == 200  # it goes on
    brain_server = server.server
    assert brain_server.closed and set(brain_server.lost) == {"keeper"}
    assert exit_status(brain_server) == 1
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "sessions could not be checkpointed" in logged and "keeper" in logged


def test_a_clean_shutdown_exits_0(tiny, tmp_path, live_server, server_settings):
    with live_server(tiny, server_settings(tmp_path)) as server:
        assert server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                               "user": "fine"}).status_code == 200
    assert server.server.lost == {} and exit_status(server.server) == 0


def test_positronic_serve_exits_1_when_it_cannot_save_its_sessions(tmp_path, chat, serve_process):
    sessions = tmp_path / "sessions"
    process, url = serve_process("--budget", "64", "--session-dir", str(sessions), "-t", "1",
                                 "--checkpoint-when-idle")  # so that the session is first saved at the shutdown
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert chat(client, "doomed", "hello").choices[0].finish_reason == "length"
        shutil.rmtree(sessions, ignore_errors=True)  # nothing saved yet: it may not exist
        sessions.write_text("the session directory became a file")
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
        assert process.wait(30) == 1, rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "session doomed could not be checkpointed" in rest
    assert "error: 1 sessions could not be checkpointed" in rest and "doomed" in rest

"""`positronic serve` (positronic/cli/serve.py): bad flags refused before a model loads, and a
real server process that serves and saves its sessions on SIGTERM."""

import socket

import httpx
import openai
import pytest

from positronic.brain import session as sessions

MODEL = "random:tiny"


def test_serve_refuses_bad_flags_before_loading_a_model(tmp_path, capsys, run_cli):
    assert run_cli("serve", "-m", "no-such-model-anywhere", "--kv-eviction", "1", "--policy", "h2o") == 2
    assert "set the same thing" in capsys.readouterr().err
    assert run_cli("serve", "-m", "no-such-model-anywhere", "--budget", "8") == 2
    assert "budget 8" in capsys.readouterr().err
    assert run_cli("serve", "-m", MODEL, "--max-tokens", "10", "--default-max-tokens", "20",
                   "--session-dir", str(tmp_path)) == 2
    capsys.readouterr()
    assert run_cli("serve", "-m", MODEL, "--served-model-name", "a", "--served-model-name", "a",
                   "--session-dir", str(tmp_path)) == 2
    assert "--served-model-name must be distinct, non-empty names" in capsys.readouterr().err
    # vLLM's spelling, several names after one flag: the same names, checked the same way
    assert run_cli("serve", "-m", MODEL, "--served-model-name", "a", "a", "--session-dir", str(tmp_path)) == 2
    assert "--served-model-name must be distinct, non-empty names, got ['a', 'a']" in capsys.readouterr().err
    assert run_cli("serve", "-m", "no-such-model-anywhere", "--compile", "--no-engine") == 2
    assert "--compile compiles the engine's rounds" in capsys.readouterr().err


def test_compile_on_a_model_it_cannot_run_is_one_line_before_serving(tmp_path, capsys, run_cli):
    assert run_cli("serve", "-m", "random:qwen2", "--compile", "--session-dir", str(tmp_path)) == 2
    assert "--compile: a compiled round runs Llama-class models; Qwen2ForCausalLM is not one" in capsys.readouterr().err


def test_several_names_after_one_flag_are_each_a_value():
    from positronic.cli import spread_lists

    assert spread_lists(["serve", "--served-model-name", "a", "b", "--port", "0", "-p", "x", "y"]) == [
        "serve", "--served-model-name", "a", "--served-model-name", "b", "--port", "0", "-p", "x", "y"]


def test_a_second_server_on_a_session_dir_in_use_is_refused_before_loading_a_model(tmp_path, capsys, run_cli,
                                                                                   monkeypatch):
    import positronic.cli.serve as serve_module

    monkeypatch.setattr(serve_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with sessions.locked(tmp_path, "positronic serve"):
        assert run_cli("serve", "-m", MODEL, "--session-dir", str(tmp_path)) == 2
    assert "is in use by positronic serve (pid" in capsys.readouterr().err


def test_positronic_serve_serves_and_saves_its_sessions_on_sigterm(tmp_path, chat, serve_process):
    process, url = serve_process("--budget", "64", "--kv-sink-tokens", "2", "--session-dir", str(tmp_path), "-t", "1")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert chat(client, "cli", "hello").choices[0].finish_reason == "length"
        assert httpx.get(url + "/health").json()["budget"] == 64
        process.terminate()
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (tmp_path / "cli" / "mirror.msgpack").exists()
    assert sessions.load(tmp_path / "cli")[1]["config"]["sinks"] == 2  # the llama.cpp alias reached the brain


def test_an_empty_api_key_in_the_environment_is_refused_not_served_open(tmp_path, capsys, run_cli, monkeypatch):
    """click reads an empty variable as unset: the server started with no key at all."""
    monkeypatch.setenv("POSITRONIC_API_KEY", "")
    assert run_cli("serve", "-m", "no-such-model-anywhere", "--session-dir", str(tmp_path / "new")) == 2
    err = capsys.readouterr().err
    assert "$POSITRONIC_API_KEY is set but empty" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("flags, says", [
    (("--host", "999.1.1.1"), "--host '999.1.1.1' is not an address of this machine"),
    (("--host", "192.0.2.1"), "(--host '192.0.2.1')"),  # TEST-NET-1: an address, but not this machine's
    (("--port", "PORT"), "(--port PORT): Address already in use"),
])
def test_an_address_it_cannot_listen_on_is_one_line_before_the_model_loads(tmp_path, capsys, run_cli, flags, says):
    """It was several log lines and exit 3 once the model had loaded (no-such-model-anywhere: the
    check must come first for the line to be about the address)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        flags = tuple(port if flag == "PORT" else flag for flag in flags)
        assert run_cli("serve", "-m", "no-such-model-anywhere", "--session-dir", str(tmp_path / "new"), *flags) == 2
    err = capsys.readouterr().err
    assert says.replace("PORT", port) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists()

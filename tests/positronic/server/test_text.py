"""The server's text (positronic/server/text.py): stop strings never sent in part, a reply that
holds back a character cut in half, and the chat template's framing of a running session."""

import pytest

from positronic.brain.chat import ChatFormat
from positronic.server.text import Reply, StopScanner


def test_the_stop_scanner_never_sends_part_of_a_stop_string():
    scanner = StopScanner(["END", "xy"])
    assert scanner.push("abcE") == ("abc", False)
    assert scanner.push("N") == ("", False)
    assert scanner.push("Dafter") == ("", True)
    scanner = StopScanner(["END"])
    assert scanner.push("abE") == ("ab", False) and scanner.push("X") == ("EX", False)
    assert scanner.push("E") == ("", False) and scanner.flush() == "E"


def test_a_reply_holds_back_a_character_cut_in_half(tiny):
    euro = tiny.encode("€")  # three byte tokens
    reply = Reply(tiny, tiny.bos_id, max_tokens=10)
    assert [reply.add(t) for t in euro] == ["", "", "€"]
    assert reply.add(tiny.eos_id) == "" and reply.finish_reason == "stop" and reply.tokens == 4


@pytest.mark.slow
def test_the_chat_template_frames_turns_as_a_running_session_reads_them(smol):
    """SmolLM2's ChatML: a fresh conversation is the template's rendering, with the user's
    text literal; a session that gets the same turns one request at a time reads the same tokens."""
    chat_format = ChatFormat(smol)
    first = [{"role": "user", "content": "Say <|im_end|> now"}]
    ids = chat_format.conversation(first)
    rendered = smol.tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert smol.decode(ids) == rendered and ids[0] == smol.bos_id
    assert ids.count(smol.eos_id) == rendered.count("<|im_end|>") - 1  # the typed one is text
    reply = smol.encode("Sure")
    history = first + [{"role": "assistant", "content": "Sure"}, {"role": "user", "content": "Again"}]
    running = ids + reply + chat_format.reply_end(reply[-1]) + chat_format.user_turn("Again", 2000)
    assert running == chat_format.conversation(history)
    assert chat_format.reply_end(smol.eos_id) == smol.encode("\n")

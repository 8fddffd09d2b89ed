"""Conversation mode (positronic/brain/dialogue.py, `run -cnv`): each line a user turn, the reply
until the model ends its turn or the limit, the closing read in, then the next line."""

from __future__ import annotations

import queue
import subprocess
import sys
from pathlib import Path

import pytest

from positronic.brain import session as sessions
from positronic.brain.chat import END_OF_INPUT, ChatFormat
from positronic.brain.dialogue import Dialogue
from positronic.brain.loop import Brain, BrainConfig
from positronic.brain.runner import Runner

ROOT = Path(__file__).resolve().parents[3]


def lines(*texts) -> queue.SimpleQueue:
    q = queue.SimpleQueue()
    for text in texts:
        q.put(text)
    q.put(END_OF_INPUT)
    return q


def converse(lm, texts, *, reply_tokens=6, ignore_eos=False, **config):
    """The brain and the dialogue after a run over `texts`, and every tick's (source, token, shown, ended)."""
    dialogue = Dialogue(lm, lines(*texts[1:]), reply_tokens=reply_tokens, ignore_eos=ignore_eos)
    brain = Brain.start(lm, dialogue.opening(texts[0]), BrainConfig(budget=96, temperature=0, **config))
    seen = []
    Runner(brain, lm.name, None, dialogue=dialogue).run(
        lambda record, result: seen.append((record.source, record.token_id, dialogue.shown, dialogue.ended)))
    return brain, dialogue, seen


def test_each_line_is_a_turn_and_each_reply_ends_at_its_limit_then_the_input_ends_the_run(tiny):
    """Plain frame (no chat template): the first line opens the context as the server's chat
    would, the reply is 6 generated tokens, the next line is read as a user turn (blank lines
    skipped), its reply 6 more, and the end of the input ends the run."""
    brain, dialogue, seen = converse(tiny, ["hello", "", "bye"])
    opening = ChatFormat(tiny).conversation([{"role": "user", "content": "hello"}])
    assert brain.state.mirror.ledger.entries[0].token_id == tiny.bos_id
    assert [e.token_id for e in brain.state.mirror.ledger.entries[:len(opening)]] == opening
    generated = [t for source, t, shown, ended in seen if source == "generated"]
    typed = [t for source, t, shown, ended in seen if source == "user"]
    assert len(generated) == 12 and dialogue.replies == 2
    assert typed == tiny.encode("\nUser: bye\nAssistant:")
    assert [ended for *_, ended in seen].count(True) == 2 and all(shown for s, _, shown, _ in seen if s == "generated")
    assert seen[5][3] and seen[6][0] == "user", "the second turn is read right after the first reply ends"


def test_a_reply_ends_at_end_of_sequence_unless_ignore_eos(tiny):
    """The model writes its end-of-sequence token (made certain by a logit bias): the reply ends
    there and the token is not shown; with ignore_eos the reply runs to its limit."""
    bias = f"{tiny.eos_id}:100"
    _, dialogue, seen = converse(tiny, ["hello", "again"], logit_bias=bias)
    assert dialogue.replies == 2
    replies = [(t, shown, ended) for source, t, shown, ended in seen if source == "generated"]
    assert replies == [(tiny.eos_id, False, True)] * 2
    _, dialogue, seen = converse(tiny, ["hello"], logit_bias=bias, ignore_eos=True, reply_tokens=4)
    assert [(t, ended) for source, t, _, ended in seen if source == "generated"] == \
           [(tiny.eos_id, False)] * 3 + [(tiny.eos_id, True)]


def test_a_line_too_long_for_a_turn_is_refused_and_the_next_one_is_answered(tiny):
    refused = []
    dialogue = Dialogue(tiny, lines("z" * 300, "ok"), reply_tokens=3, on_refused=refused.append)
    brain = Brain.start(tiny, dialogue.opening("hi"), BrainConfig(budget=96, temperature=0))
    Runner(brain, tiny.name, None, dialogue=dialogue).run(lambda record, result: None)
    assert len(refused) == 1 and "input refused" in refused[0]
    assert dialogue.replies == 2


def cli(*flags, stdin: bytes, session: Path | None = None, model: str = "random:tiny") -> subprocess.CompletedProcess:
    args = [sys.executable, "run.py", "--model", model, "--no-tui", *flags]
    if session is not None:
        args += ["--session", str(session)]
    return subprocess.run(args, cwd=ROOT, input=stdin, capture_output=True, timeout=600)


@pytest.mark.long
def test_run_cnv_answers_each_piped_line_in_the_chat_template_it_is_given(tiny, tmp_path):
    """`run.py -cnv --chat-template chatml -n 5` with two lines piped: two replies on stdout, one
    line each, nothing of the turns' text; the session holds each turn in ChatML's frame and the
    closing after the first reply; the summary goes to stderr."""
    done = cli("-cnv", "--chat-template", "chatml", "-n", "5", "--temp", "0", stdin=b"hello\nhow are you\n",
               session=tmp_path / "s")
    assert done.returncode == 0, done.stderr.decode()
    out, err = done.stdout.decode(), done.stderr.decode()
    assert out.count("\n") == 2 and "hello" not in out and "im_start" not in out
    assert "replies 2" in err and "--- summary ---" in err
    text = tiny.decode([e.token_id for e in sessions.resume(tiny, tmp_path / "s").state.mirror.ledger.entries])
    assert "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n" in text
    assert "<|im_end|>\n<|im_start|>user\nhow are you<|im_end|>\n<|im_start|>assistant\n" in text


@pytest.mark.long
def test_run_cnv_refusals_name_the_flag(tmp_path):
    for flags, message in ((["-i", "--no-conversation"], "-i/--interactive is conversation mode here"),
                           (["-cnv", "--no-input"], "conversation mode reads its turns from stdin"),
                           (["--chat-template", "nope"], "--chat-template 'nope' is not a template name"),
                           (["--chat-template", "{% if %}"], "the Jinja template does not parse")):
        done = cli(*flags, stdin=b"hello\n")
        assert done.returncode == 2 and message in done.stderr.decode(), (flags, done.stderr.decode())


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.smollm2
def test_a_question_piped_to_the_embedded_model_is_answered_as_a_chat(smol):
    """The issue's first command: `echo "What is the capital of France?" | run.py --no-tui -n 40`
    answers the question (conversation mode, since the model has a chat template and no prompt
    was given) instead of continuing the default story with the template's markers in it;
    -no-cnv keeps the story."""
    done = cli("-n", "40", "--temp", "0", stdin=b"What is the capital of France?\n", model="smollm2")
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert "conversation mode" in done.stderr.decode()
    assert "Paris" in out and "im_start" not in out and "clockmaker" not in out
    done = cli("-no-cnv", "-n", "8", stdin=b"What is the capital of France?\n", model="smollm2")
    assert done.returncode == 0 and "clockmaker" in done.stdout.decode()


def test_each_reply_keeps_to_the_grammar_and_ends_when_it_is_whole(tiny):
    """With a grammar (run -j/--grammar in conversation mode) each reply is drawn under a fresh
    constraint and ends when the grammar is whole, before the limit; the turns read in between
    are not constrained."""
    pytest.importorskip("llguidance")
    from positronic.brain.grammar import Grammar

    grammar = Grammar.json_schema({"type": "integer", "minimum": 0, "maximum": 120})
    dialogue = Dialogue(tiny, lines("again", "and again"), reply_tokens=40, grammar=grammar)
    brain = Brain.start(tiny, dialogue.opening("how old?"), BrainConfig(budget=96, temperature=1.0, seed=3))
    dialogue.constrain(brain)
    replies, current = [], []

    def on_tick(record, result):
        if dialogue.shown:
            current.append(record.token_id)
        if dialogue.ended:
            replies.append(tiny.decode(current))
            current.clear()
    Runner(brain, tiny.name, None, dialogue=dialogue).run(on_tick)
    assert len(replies) == 3 and dialogue.replies == 3
    assert all(reply.isdigit() and 0 <= int(reply) <= 120 for reply in replies), replies


def test_run_with_a_grammar_writes_text_that_matches_it_then_ends(tmp_path, run_cli, capsys):
    """`run -j SCHEMA` and `--grammar-file GBNF`: the generated text is exactly what the grammar
    allows, and the run ends when it is whole (before -n); a grammar that cannot be read, two at
    once, or one with --resume are refused by name before the model runs."""
    pytest.importorskip("llguidance")
    import json
    import re

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    base = ("--model", "random:tiny", "--no-tui", "--no-input", "-n", "80")
    assert run_cli(*base, "-p", "Data:", "-j", json.dumps(schema)) == 0
    out = capsys.readouterr().out
    text = out.split("\n--- summary ---")[0].removeprefix("Data:")
    assert set(json.loads(text)) == {"n"} and "(grammar complete)" in out
    (tmp_path / "g.gbnf").write_text('root ::= ("yes" | "no") "."\n')
    assert run_cli(*base, "-p", "Q:", "--grammar-file", str(tmp_path / "g.gbnf"), "--temp", "1") == 0
    out = capsys.readouterr().out
    assert re.match(r"Q:(yes|no)\.\n--- summary --- \(grammar complete\)", out), out
    for flags, message in [(("--grammar", "root ::= nope"), "Rule 'nope' not found"),
                           (("--grammar", 'root ::= "a"', "-j", "{}"), "give one of --grammar, --json-schema"),
                           (("--json-schema-file", str(tmp_path / "missing.json")), "cannot read --json-schema-file"),
                           (("-j", "{}", "--resume", "--session", str(tmp_path / "s")), "cannot go with --resume")]:
        assert run_cli(*base, *flags) != 0
        assert message in capsys.readouterr().err, flags

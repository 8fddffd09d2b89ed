"""Preparing a turn: what a generation request adds to its conversation, made ready for its ticks.

    preparer = Preparer(lm, config, worker, chat_format, off_loop, history_edits="refuse")
    turn, answer = await preparer.begin_turn(conversation, body, chat, key, options)

A completion's prompt or a chat's messages become token ids (tokenized in the server's text
thread, `off_loop`, never on the event loop), checked against the limits (rules.py), and then
either prefilled into a fresh brain (a job of the model worker) or queued on the running
session's conversation (read later, a tick a token, by the turn's own job). A retried request
(an Idempotency-Key the session took: answers.py) takes up its earlier reply instead. The
result is a Turn (turn.py) whose `prepared` says what the input did (Prepared: tokens added,
echoed log-probabilities, prompt tokens pruned). The request holds its conversation throughout
(pool.py): nothing else changes the session meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from ..brain.chat import TurnRefused, turn_limit
from ..brain.loop import BrainConfig
from . import answers, rules
from .conversation import Conversation
from .history import History
from .logprobs import of_prompt
from .schemas import APIError, GenerationBody, Message, message_text
from ..brain.chat import ChatFormat
from .tools import Tools
from .turn import Prepared, Turn
from .worker import ModelWorker

log = logging.getLogger("positronic.server.app")


def prompt_messages(said: list[tuple[str, str]], tools: Tools | None) -> list[dict]:
    """A fresh conversation's messages for the chat template: a tool's answer as a user turn
    (its text carries the tags), and the tools described in the system message (the first
    one's text extended, or one put first)."""
    messages = [{"role": "user" if role == "tool" else role, "content": text} for role, text in said]
    if tools is not None:
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": messages[0]["content"].rstrip() + "\n\n" + tools.preamble()}
        else:
            messages.insert(0, {"role": "system", "content": tools.preamble()})
    return messages


class Preparer:
    """Makes a request's input ready for its turn (the module's docstring). `off_loop(fn,
    *args)` runs `fn` in the server's text thread (BrainServer.off_loop); `history_edits`: what a
    chat whose earlier messages differ from its session's gets (refuse: 409 | rebuild)."""

    def __init__(self, lm, config: BrainConfig, worker: ModelWorker, format: ChatFormat,
                 off_loop: Callable[..., Awaitable], *, history_edits: str = "refuse"):
        self.lm, self.config, self.worker, self.format = lm, config, worker, format
        self.off_loop, self.history_edits = off_loop, history_edits

    def fresh_config(self, seed: int | None) -> BrainConfig:
        return self.config if seed is None else dataclasses.replace(self.config, seed=seed)

    async def begin_session(self, conversation: Conversation, ids: list[int], config: BrainConfig,
                            echo: int | None) -> Prepared:
        """A fresh brain on `ids`. Past the budget the policy prunes the prompt (Brain.start);
        with `echo` (the alternatives to list) it prefills the budget's worth instead, their
        log-probabilities exact (a plain forward), and reads the rest token by token, each
        teacher-forced through the bounded cache."""
        if echo is None or len(ids) <= config.budget:
            await self.worker.run(conversation.start, self.lm, ids, config, owner=conversation)
            pruned = len(ids) - conversation.brain.state.rows_per_layer
            echoed = [] if echo is None else await self.worker.run(self.worker.meeting.call, of_prompt, self.lm, ids,
                                                                     echo)  # in the forward thread
            return Prepared(len(ids), echoed, pruned, "exact")
        head = ids[:config.budget]
        await self.worker.run(conversation.start, self.lm, head, config, owner=conversation)
        conversation.queue(forced=ids[config.budget:])
        echoed = await self.worker.run(self.worker.meeting.call, of_prompt, self.lm, head, echo)
        return Prepared(len(ids), echoed, 0, f"exact for the first {len(head)} prompt tokens, then teacher-forced "
                                             "through the session's bounded cache")

    async def settle(self, conversation: Conversation) -> None:
        """Read what an earlier request left unread (it went away mid-turn), a tick a token, in one job."""
        if conversation.reading:
            await self.worker.run(conversation.settle, owner=conversation)

    async def prepare_completion(self, conversation: Conversation, prompt, seed: int | None,
                                 echo: int | None = None) -> Prepared:
        """Queue a completion's prompt: a fresh brain prefills BOS + the prompt; a running
        session reads the prompt's tokens after its context. With `echo`, the prompt tokens'
        log-probabilities where they are prefilled (a running session's: Turn.read)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list of one (several are choices of their own: rules.prompts_of)
        if isinstance(prompt, list):
            ids = list(prompt)
        else:  # known too long by its length alone: refused before any encoding
            fewest = self.lm.fewest_tokens(prompt)
            if conversation.brain is None:
                limit, why = rules.prompt_limit(self.lm, self.fresh_config(seed))
                if fewest + 1 > limit:  # and the BOS
                    raise rules.too_long("the prompt", fewest + 1, limit, why, "prompt", at_least=True)
            elif fewest > (limit := turn_limit(conversation.brain.config)):
                raise rules.too_long("the prompt", fewest, limit, rules.PROMPT_WHY, "prompt", at_least=True)
            ids = await self.off_loop(self.lm.encode, prompt)
        rules.check_ids(ids, self.lm.vocab_size)
        if conversation.brain is None:
            config = self.fresh_config(seed)
            sent = len(ids)
            if not isinstance(prompt, list) or ids[:1] != [self.lm.bos_id]:
                ids = [self.lm.bos_id] + ids
            limit, why = rules.prompt_limit(self.lm, config)
            if len(ids) > limit:
                raise rules.too_long("the prompt", len(ids), limit, why, "prompt")
            prepared = await self.begin_session(conversation, ids, config, echo)
            prepared.echoed = prepared.echoed[len(ids) - sent:]  # the tokens the client sent (not a BOS added)
            return prepared
        limit = turn_limit(conversation.brain.config)
        if len(ids) > limit:
            raise rules.too_long("the prompt", len(ids), limit, rules.PROMPT_WHY, "prompt")
        rules.check_room(conversation, len(ids), "prompt")
        await self.settle(conversation)
        conversation.queue(forced=ids)
        return Prepared(len(ids), [], 0, "teacher-forced through the session's bounded cache")

    async def prepare_chat(self, conversation: Conversation, messages: list[Message], seed: int | None,
                           tools: Tools | None = None) -> int:
        """Queue a chat's new part: a fresh brain prefills the whole conversation in the chat
        template (with `tools`, their description in its system message: tools.py); a running
        session reads the user messages (and tools' answers) after the last assistant message,
        each as a user turn, after closing its previous reply. Returns the tokens added."""
        texts = [message_text(message, i) for i, message in enumerate(messages)]
        said = [(m.role, t) for m, t in zip(messages, texts)]
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        new = list(range(last + 1, len(messages)))
        if conversation.brain is not None and (not new or any(messages[i].role not in ("user", "tool") for i in new)):
            raise APIError(400, "messages: in a running session a request ends with its new user message(s) (or "
                                "tools' answers) after the last assistant message (the session remembers the rest)",
                           param="messages", code="invalid_value")
        if conversation.brain is not None and (at := conversation.history.differs(said[:last + 1])) is not None:
            if self.history_edits != "rebuild":
                name = f"session {conversation.id!r}" if conversation.id else "the session"
                raise APIError(409, f"messages.{at}: the conversation's earlier messages differ from {name}'s (an "
                                    "edited or regenerated message?); send the history as the session answered it, or "
                                    "only the new message(s), or start a new session (a server run with "
                                    "--history-edits rebuild starts the session again from the messages instead)",
                               param=f"messages.{at}", code="history_mismatch")
            await self.settle(conversation)  # what it was reading goes with it
            conversation.brain, conversation.history = None, History(None)
            log.info("session %s starts again from a request's edited history", conversation.id)
        if conversation.brain is None:
            config = self.fresh_config(seed)
            limit, why = rules.prompt_limit(self.lm, config)
            if (fewest := 1 + sum(self.lm.fewest_tokens(text.strip()) for _, text in said)) > limit:
                raise rules.too_long("the conversation", fewest, limit, why, "messages", at_least=True)
            ids = await self.off_loop(self.format.conversation, prompt_messages(said, tools))
            if len(ids) > limit:
                raise rules.too_long("the conversation", len(ids), limit, why, "messages")
            prepared = await self.begin_session(conversation, ids, config, None)
            conversation.history = History(said)
            return prepared
        limit = turn_limit(conversation.brain.config)
        for i in new:
            if (fewest := self.lm.fewest_tokens(texts[i].strip())) > limit:
                raise rules.too_long(f"messages.{i} as a user turn", fewest, limit, "a turn may take here (the "
                                     "budget less the protected rows)", "messages", at_least=True)
        try:
            turns = await self.off_loop(lambda: [self.format.user_turn(texts[i], limit) for i in new])
        except TurnRefused as exc:
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        await self.settle(conversation)  # input an earlier request left unread (already accepted)

        def queue() -> int:  # in the text thread: the turns are tokenized again as the brain takes them
            closing = self.format.reply_end(conversation.last_token())
            adding = len(closing) + sum(map(len, turns))
            rules.check_room(conversation, adding, "messages")
            conversation.queue(forced=closing, turns=[texts[i] for i in new])
            return adding

        adding = await self.off_loop(queue)
        conversation.history.said([said[i] for i in new])
        return Prepared(adding)

    async def begin_turn(self, conversation: Conversation, body: GenerationBody, chat: bool, key: str | None,
                         options: dict) -> tuple[Turn, answers.Answer | None]:
        """The request's turn (`options`: Turn's reply settings; `turn.prepared`: what its input
        did) and its keyed answer: a retried key (answers.py) takes up its earlier reply instead
        of queueing the input again."""
        if key is not None:
            print_ = answers.fingerprint(body, chat)
            if (answer := conversation.answers.find(key, print_)) is not None:
                reply = conversation.answers.resumed_reply(self.lm, options["max_tokens"], options["stops"],
                                                           options["ignore_eos"], options["stop_ids"])
                turn = Turn(conversation, self.worker, self.lm, reply=reply, retried=True, **options)
                turn.prepared = Prepared(answer.prompt_tokens)
                return turn, answer
        if chat:
            prepared = await self.prepare_chat(conversation, body.messages, body.seed, options.get("tools"))
        else:
            echo = options["logprobs"] if options["echo"] else None
            prepared = await self.prepare_completion(conversation, body.prompt, body.seed, echo)
        if key is None:
            conversation.answers.forget()
            answer = None
        else:
            answer = conversation.answers.begin(key, print_, prepared.tokens)
        turn = Turn(conversation, self.worker, self.lm, **options)
        turn.prepared = prepared
        return turn, answer

"""The edits of each tick in words, for the live view's "last edits" panel."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .render import display_text

if TYPE_CHECKING:  # imported for annotations only: the loop module pulls in torch
    from ..brain.loop import Brain, TickRecord
    from ..models import LoadedModel

ACTION_LOG = 200  # action lines kept (the view shows the newest that fit)


def short(text: str, limit: int = 24) -> str:
    """A token text for the action log: one line, trimmed, quoted."""
    text = display_text(text).replace("\n", "").strip()
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return f"'{text}'"


def describe_actions(tick: int, actions: list[dict], row_text, decode, ledger_text=lambda i: "?") -> list[str]:
    """Each position-editing action in words; `row_text(row)` gives a live row's text before
    the edits, `decode(ids)` the text of new tokens, `ledger_text(id)` a ledger entry's (what
    a restore brings back). Adds are left out: the generated token shows at the end of the
    context anyway."""
    lines = []
    for action in actions:
        kind = action.get("action")
        if kind == "replace_pair":
            p1, p2 = action["original_pos1"], action["original_pos2"]
            old = row_text(p1) + row_text(p2)
            lines.append(f"t{tick} replace {p1}–{p2} {short(old)} → {short(decode(action['new_token_ids']))}")
        elif kind == "delete":
            lines.append(f"t{tick} delete {action['position']} {short(row_text(action['position']))}")
        elif kind == "restore":
            ids = action["ledger_ids"]
            text = "".join(ledger_text(i) for i in sorted(ids))
            lines.append(f"t{tick} recall {len(ids)} row{'s' * (len(ids) != 1)} {short(text)}")
        elif kind == "drop":
            count = len(action["rows"][0])
            lines.append(f"t{tick} drop {count} row{'s' * (count != 1)} per layer")
        elif kind == "reread":
            lines.append(f"t{tick} reread the newest token with what came back")
    return lines


class ActionRecorder:
    """An Observer (positronic.brain.loop): writes each tick's edits in words into `lines`.

    The texts must be read before Step 4 moves the rows, so `before_apply` reads them
    (only the rows the actions touch) in the loop thread; the view copies `lines` into
    its snapshots.
    """

    def __init__(self, lm: "LoadedModel", keep: int = ACTION_LOG):
        self.lm = lm
        self.lines: deque[str] = deque(maxlen=keep)

    def before_apply(self, brain: "Brain", actions: list[dict], brightness=None) -> None:
        live, entries = brain.state.mirror.live.ledger_ids, brain.state.mirror.ledger.entries

        def row_text(row: int) -> str:
            return entries[live[row]].text if isinstance(row, int) and 0 <= row < len(live) else "?"

        def ledger_text(ledger_id: int) -> str:
            return entries[ledger_id].text if isinstance(ledger_id, int) and 0 <= ledger_id < len(entries) else "?"

        self.lines.extend(describe_actions(brain.tick, actions, row_text, self.lm.decode, ledger_text))

    sees_rounds = True  # a tick made as an engine round comes to `round` instead (brain/loop.Observer)

    def round(self, brain: "Brain", record: "TickRecord") -> None:
        """A tick made as an engine round (`Batch(texts=True)`): its edits in words, from the
        record (no Observer saw it): each delete with the text it took out, each lane's drops."""
        if record.rebuilt:
            self.lines.append(f"t{record.tick} REBUILT the cache from the mirror: {record.error}")
            return
        deleted = sorted(action["position"] for action in record.actions if action["action"] == "delete")
        texts = dict(zip(deleted, (row["text"] for row in record.removed)))  # removed: in row order
        self.lines.extend(describe_actions(record.tick, record.actions, lambda row: texts.get(row, "?"), self.lm.decode))

    def after_apply(self, brain: "Brain", actions: list[dict], report) -> None:
        if report.rebuilt:
            self.lines.append(f"t{brain.tick} REBUILT the cache from the mirror: {report.error}")

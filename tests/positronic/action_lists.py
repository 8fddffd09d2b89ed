"""Random valid action lists, and a plain-list model of what they do to a sequence."""

from __future__ import annotations

import random


def random_actions(rng: random.Random, length: int, vocab: int, *, keep_first: int = 0, max_edits: int = 4,
                   max_new: int = 3, adds: tuple[int, int] = (0, 2)) -> list[dict]:
    """A valid action list for a context of `length` rows; rows below `keep_first` are never edited."""
    free = list(range(keep_first, length))
    rng.shuffle(free)
    taken: set[int] = set()
    actions = []
    for row in free[: rng.randint(0, max_edits)]:
        if row in taken:
            continue
        if rng.random() < 0.6 and row + 1 < length and row + 1 not in taken:
            taken |= {row, row + 1}
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, max_new))]
            actions.append({"action": "replace_pair", "original_pos1": row, "original_pos2": row + 1, "new_token_ids": new})
        else:
            taken.add(row)
            actions.append({"action": "delete", "position": row})
    actions += [{"action": "add", "token_id": rng.randrange(vocab)} for _ in range(rng.randint(*adds))]
    rng.shuffle(actions)
    if sum(a["action"] == "add" for a in actions) == 0 and len(taken) >= length:
        actions.append({"action": "add", "token_id": rng.randrange(vocab)})
    return actions


def apply_to_list(sequence: list[int], actions: list[dict]) -> list[int]:
    """What Step 4 must do to the token sequence, written as plainly as possible."""
    result = list(sequence)
    edits = [a for a in actions if a["action"] != "add"]
    edits.sort(key=lambda a: a.get("original_pos2", a.get("position")), reverse=True)
    for action in edits:
        if action["action"] == "delete":
            del result[action["position"]]
        else:
            p1, p2 = action["original_pos1"], action["original_pos2"]
            result[p1 : p2 + 1] = action["new_token_ids"] + result[p1 + 1 : p2]
    return result + [a["token_id"] for a in actions if a["action"] == "add"]

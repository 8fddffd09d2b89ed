"""How an edit moves the cache's rows, one class per way the layers hold them:

    SharedRows  every layer holds the live rows (any kv_format, splice or ring store): the
                cache moves them as the layout says and re-rotates keys whose position moved
    LaneRows    lanes (layers, or the kv heads of each layer) keep different rows (a per-layer
                policy: SmartKV): each lane closes up over the rows it drops, takes recalled
                rows back into gaps with their stored K/V, and the new token is appended in
                every lane

The StateManager runs either through the same stages (manager._write): `splice`, `rotate`,
one forward into the rows `gaps` names (keys at `key_positions`), then `commit` to the mirror.
Also here, the helpers those stages share: new tokens' texts, restored tokens' places, how
many keys a layout re-rotates, stored rows copied in.
"""

from __future__ import annotations

import bisect

import torch

from positronic.mirror import Insertion, Layout, Mirror, plan_layout, runs_without

from ..kv import rope
from ..text import span_texts
from .actions import ActionError


class SharedRows:
    """Every layer holds the live rows: one layout moves all of them alike."""

    def __init__(self, mirror: Mirror, deleted: list[int], insertions: list[Insertion], limit: int):
        self.layout = plan_layout(mirror.live.positions, deleted, insertions, limit)  # ValueError: nothing touched
        self.length = self.layout.length  # rows per layer afterwards

    @property
    def changed(self) -> bool:
        """Whether the forward that wrote the old newest row is history now."""
        layout = self.layout
        return bool(layout.deleted or layout.new_rows or layout.moved is not None)

    def splice(self, cache, scratch: int, probe_positions=()) -> None:
        """Move surviving rows into place, gaps for the new ones (and `scratch` rows after them)."""
        layout = self.layout
        if layout.old_length:
            cache.splice(list(layout.kept), layout.length + scratch)
        else:
            cache.reserve(layout.length)  # a ring lays out its mask before the prefill: room first
        # int4h reads every key at its row's position (a moved row's re-rotation), probes' scratch rows included
        cache.set_positions(layout.positions, probe_positions)

    def rotate(self, cache, inv_freq: torch.Tensor) -> None:
        """Re-rotate the keys from the first moved row on (unmoved ones get an identity: exact)."""
        layout = self.layout
        if layout.moved is not None:
            cos, sin = rope.rotation(inv_freq, torch.tensor(layout.old_positions[layout.moved:]),
                                     torch.tensor(layout.positions[layout.moved:]))
            cache.rotate_keys(layout.moved, cos, sin)

    def gaps(self, rows: list[int], scratch: int) -> list[int]:
        """The cache rows the forward writes: the new rows, then the scratch rows."""
        return rows + list(range(self.length, self.length + scratch))

    def key_positions(self) -> list[int]:
        return list(self.layout.positions)

    def commit(self, mirror: Mirror, cache, texts: list[str], **stamp) -> None:
        mirror.splice(self.layout, texts, ring=cache.ring, **stamp)


class LaneRows:
    """Lanes keep different rows: lane l drops its rows drops[l], takes back the ledger ids
    inserts[l] (recall: their own K/V, `stored`, copied into that lane alone), then every lane
    appends `adds` (at most one token). A token no lane holds any more leaves the live map (the
    union) and a token taken back that no lane held rejoins it, which the layout describes;
    each lane's own rows move by its own runs."""

    changed = True  # the newest row's attention covered the lanes' old rows: always history

    def __init__(self, mirror: Mirror, drops: list[list[int]], adds: list[int], source: str, limit: int,
                 lanes_per_layer: int, inserts: list[list[int]] | None = None, stored: dict | None = None):
        inserts = inserts or [[] for _ in drops]
        kept = mirror.layers.after(drops, [], inserts)  # LayerRowsError (a ValueError): nothing touched yet
        live = mirror.live.ledger_ids
        deleted = [row for row, ledger_id in enumerate(live) if ledger_id not in kept.counts]
        rejoining = tuple(sorted(set(kept.counts) - set(live)))
        insertions = restorations(mirror, rejoining, set(deleted)) if rejoining else []
        insertions += [Insertion(len(mirror), (token_id,), source) for token_id in adds]
        self.layout = layout = plan_layout(mirror.live.positions, deleted, insertions, limit)
        self.drops, self.inserts, self.kept_ids, self.heads = drops, inserts, kept.rows, lanes_per_layer
        self.stored = stored or {}
        old_rows = mirror.layers.rows
        # ids ascend with position in every lane, so a taken-back token's row is a search away
        self.taken_rows = [[bisect.bisect_left(ids, i) for i in taken] for taken, ids in zip(inserts, kept.rows)]
        self.runs = [runs_without(len(old), dropped, sorted(rows))
                     for old, dropped, rows in zip(old_rows, drops, self.taken_rows)]
        self.length = len(kept.rows[0]) + len(adds)  # rows per lane afterwards
        self.new_position = {ledger_id: layout.positions[new + k] for old, new, count in layout.kept
                             for k, ledger_id in enumerate(live[old:old + count])}
        for insertion, part in layout.groups:
            self.new_position.update(zip(insertion.restores, (layout.positions[row] for row in layout.new_rows[part])))
        self.old_position = {}
        if layout.moved is not None:  # a restored row's stored key is rotated at the position it held
            self.old_position = dict(zip(live, mirror.live.positions))
            self.old_position.update((i, mirror.ledger[i].position) for i in rejoining)

    def splice(self, cache, scratch: int, probe_positions=()) -> None:
        cache.splice_layers(self.runs, self.length)
        if cache.positions is not None:  # int4h reads every lane's keys at its own rows' positions
            cache.set_lane_positions([self.lane_positions(ids) for ids in self.kept_ids])
        taken = list(dict.fromkeys(i for lane in self.inserts for i in lane))  # each token once
        if not taken:
            return
        # each (lane, token) pair takes its row of the token's stored K/V, in one write
        column = {ledger_id: k for k, ledger_id in enumerate(taken)}
        keys = torch.stack([self.stored[i][0] for i in taken])  # [tokens, layers, kv_heads, head_dim]
        values = torch.stack([self.stored[i][1] for i in taken])
        layers, kv_heads = keys.shape[1:3]
        heads = self.heads  # lanes per layer: kv_heads, or 1 (a lane is a whole layer)
        lanes, rows, sources, positions = [], [], [], []
        for lane, (ids, taken_rows) in enumerate(zip(self.inserts, self.taken_rows)):
            first = lane * kv_heads // heads  # the lane's first kv head, counted over all layers
            for ledger_id, row in zip(ids, taken_rows):
                # a stored key is rotated at the position the token held (re-rotated below if that moved)
                position = self.old_position.get(ledger_id, self.new_position[ledger_id])
                for kv_lane in range(first, first + kv_heads // heads):
                    lanes.append(kv_lane), rows.append(row), sources.append(column[ledger_id] * layers * kv_heads + kv_lane)
                    positions.append(position)
        at = torch.tensor(sources, dtype=torch.long, device=keys.device)
        width = keys.shape[-1]
        cache.put_lane_rows(lanes, rows, keys.reshape(-1, width)[at], values.reshape(-1, values.shape[-1])[at],
                            positions)

    def rotate(self, cache, inv_freq: torch.Tensor) -> None:
        """Where the union's positions were packed down, each lane re-rotates its own rows."""
        if self.layout.moved is None:
            return
        heads = self.heads
        for index, layer in enumerate(cache.layers):
            lanes = self.kept_ids[index * heads : (index + 1) * heads]  # each lane its own rows
            cos, sin = (torch.stack(t) for t in zip(*(
                rope.rotation(inv_freq, torch.tensor([self.old_position[i] for i in ids]),
                              torch.tensor([self.new_position[i] for i in ids])) for ids in lanes)))
            # [lanes, rows, head_dim]: one lane (a layer) rotates every head alike
            layer.rotate_keys(0, cos[0] if heads == 1 else cos, sin[0] if heads == 1 else sin)
            # unmoved rows get an identity rotation: exact

    def gaps(self, rows: list[int], scratch: int) -> list[int]:
        """The added token goes into the last row of every lane."""
        return [self.length - 1]

    def key_positions(self) -> list[int]:
        """Lane 0's rows' positions, the new one last (only their count matters: the new token is last)."""
        return self.lane_positions(self.kept_ids[0])

    def lane_positions(self, ids: list[int]) -> list[int]:
        """A lane's rows' positions after this edit: those of `ids` (the ledger ids it keeps), then
        the added token's, if any."""
        added = list(self.layout.positions[-1:]) if self.length > len(ids) else []
        return [self.new_position[i] for i in ids] + added

    def commit(self, mirror: Mirror, cache, texts: list[str], **stamp) -> None:
        mirror.splice(self.layout, texts, layer_drops=self.drops, layer_inserts=self.inserts, **stamp)


def texts(decode, mirror: Mirror, layout: Layout) -> list[str]:
    """Each new token's text, decoded as a span after the token left of its group."""
    live = mirror.live.ledger_ids
    token_at_new_row = dict(zip(layout.new_rows, layout.new_token_ids))

    def token_at(row: int) -> int:
        if row in token_at_new_row:
            return token_at_new_row[row]
        old = next(old + row - new for old, new, count in layout.kept if new <= row < new + count)
        return mirror.ledger[live[old]].token_id

    found: list[str] = []
    for insertion, part in layout.groups:
        if insertion.restores:  # back with the text it had
            found += [mirror.ledger[i].text for i in insertion.restores]
            continue
        first = layout.new_rows[part][0]
        previous = token_at(first - 1) if first > 0 else None
        found += span_texts(decode, list(insertion.token_ids), previous)
    return found


def restorations(mirror: Mirror, ledger_ids: tuple[int, ...], deleted: set[int]) -> list[Insertion]:
    """Insertions that bring culled ledger entries back at the positions they held, one per
    gap between surviving rows. ActionError for an id that is not a culled token with a
    recorded position, or whose position a surviving row holds now."""
    ledger, live = mirror.ledger, mirror.live
    entries = []
    for ledger_id in ledger_ids:
        entry = ledger[ledger_id] if ledger_id < len(ledger) else None
        if entry is None or entry.state != "culled" or entry.position is None:
            state = "no ledger entry" if entry is None else f"{entry.state}{'' if entry.position is not None else ', no position'}"
            raise ActionError(f"restore: ledger id {ledger_id} cannot come back ({state})")
        entries.append((entry.position, ledger_id, entry))
    taken = {p for row, p in enumerate(live.positions) if row not in deleted}
    groups: dict[int, list] = {}
    for position, ledger_id, entry in sorted(entries):
        if position in taken:
            raise ActionError(f"restore: ledger id {ledger_id}'s position {position} is held by a live row")
        groups.setdefault(bisect.bisect_left(live.positions, position), []).append((position, ledger_id, entry))
    return [Insertion(row, tuple(e.token_id for _, _, e in group), group[0][2].source,
                      positions=tuple(p for p, _, _ in group), restores=tuple(i for _, i, _ in group))
            for row, group in sorted(groups.items())]


def rotated(layout: Layout) -> int:
    """How many surviving rows' keys the layout re-rotates."""
    if layout.moved is None:
        return 0
    return sum(a != b for a, b in zip(layout.old_positions[layout.moved:], layout.positions[layout.moved:]))


def lane_runs(mirror: Mirror) -> list[list[tuple[int, int, int]]]:
    """Per lane, the runs that close the live rows (every one of them, as a prefill of the
    union leaves each lane) up to the rows that lane holds."""
    runs = []
    for lane in range(mirror.layers.num_layers):
        keep = set(mirror.layer_rows_of(lane))
        runs.append(runs_without(len(mirror), [row for row in range(len(mirror)) if row not in keep]))
    return runs


def lane_positions(mirror: Mirror) -> list[list[int]]:
    """Per lane, the positions of the rows it holds, in row order (what int4h rotates keys to)."""
    positions = mirror.positions()
    return [[positions[row] for row in mirror.layer_rows_of(lane)] for lane in range(mirror.layers.num_layers)]


def copy_rows(cache, known: dict) -> None:
    """Write given K/V into live rows: known = {row: (keys, values, _)}, each
    [layers, kv_heads, head_dim] in the cache's dtype and device. They go in the way a
    forward's rows do (`fill` + `update`), so every layer kind stores them its own way
    (a packed layer encodes them)."""
    rows = sorted(known)
    keys = torch.stack([known[row][0] for row in rows], dim=2)  # [layers, kv_heads, n, head_dim]
    values = torch.stack([known[row][1] for row in rows], dim=2)
    with cache.fill(torch.tensor(rows, dtype=torch.long, device=keys.device)):
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values):
            layer.update(layer_keys[None], layer_values[None])

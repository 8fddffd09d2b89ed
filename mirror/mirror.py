"""The mirror: ledger + live map, the metadata blade of the knife.

Only StateManager calls `splice` and `set_brightness`, each time with the same Layout it
gives the cache. Nothing in this package imports torch.
"""

from __future__ import annotations

import math

from .layer_rows import LayerRows, LayerRowsError
from .layout import Layout
from .ledger import CULLED, LIVE, REPLACED, SOURCES, Ledger
from .live_map import LiveMap
from .ring import Ring


class MirrorInvariantError(AssertionError):
    """The mirror does not describe a consistent context."""


class Mirror:
    """The ledger, the live map and, when layers keep different rows (a per-layer policy),
    `layers`: each layer's rows (mirror/layer_rows.py); the live map is then their union.
    `layers` is None when every layer holds exactly the live map's rows. `ring`: with a ring
    store, the slot of every live row (mirror/ring.py: sinks, capacity and the cursor), else None."""

    def __init__(self, ledger: Ledger | None = None, live: LiveMap | None = None, layers: LayerRows | None = None,
                 ring: Ring | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.live = live if live is not None else LiveMap()
        self.layers = layers
        self.ring = ring

    def __len__(self) -> int:
        return len(self.live)

    # --- the one splice (the same Layout the cache gets) ---------------------------------

    def splice(self, layout: Layout, texts: list[str], *, tick: int, brightness: float,
               live_brightness: list[float] | None = None, layer_drops: list[list[int]] | None = None,
               layer_inserts: list[list[int]] | None = None, ring: Ring | None = None) -> list[int]:
        """Apply a whole Layout (see layout.py): deleted rows' entries retire (or become
        replaced by the tokens inserted in their place), the new tokens get ledger entries
        starting at `brightness` (a replacement starts at the brightest of the rows it
        replaces: it stands for what was there, not for news), and the live map becomes the
        layout's rows and positions.
        `live_brightness`: the tick's new brightness of every row before the edits. Returns
        the new ledger ids. Everything that could refuse is checked before the first change,
        and a failure after it (or an interrupt) undoes what was changed: all or nothing.

        With per-layer rows, `layer_drops[l]` lists the rows (of layer l) that layer drops and
        `layer_inserts[l]` the ledger ids it takes back (recall); the layout is the union's: it
        must delete exactly the tokens no layer holds any more, restore exactly the taken-back
        tokens no layer held, and otherwise only append new tokens, which every layer appends too.

        `ring`: a ring store's slots after the edit (the cache's own, so both record the same
        cursor); required exactly when the mirror has a ring.
        """
        live = self.live.ledger_ids
        if layout.old_length != len(live):
            raise ValueError(f"layout planned for {layout.old_length} rows, the live map has {len(live)}")
        layers_after = None
        if (layer_drops is None) != (self.layers is None):
            raise ValueError("per-layer drops go with per-layer rows, and only with them")
        if self.layers is not None:
            if any(insertion.replaces or (insertion.at != len(live) and not insertion.restores)
                   for insertion, _ in layout.groups):
                raise ValueError("per-layer rows take appended new tokens and restores only (no insertion or repair)")
            appended = [insertion for insertion, _ in layout.groups if not insertion.restores]
            # the ledger gives the appended tokens the next ids, in order (no replacement here)
            coming = list(range(len(self.ledger), len(self.ledger) + sum(len(i.token_ids) for i in appended)))
            layers_after = self.layers.after(layer_drops, coming, layer_inserts)  # LayerRowsError: nothing changed yet
            held_before, held_after = self.layers.held(), layers_after.held()
            gone = {live[row] for row in layout.deleted}
            if held_before - held_after != gone:
                raise ValueError("the layout must delete exactly the tokens that no layer holds any more")
            back = {i for insertion, _ in layout.groups for i in insertion.restores}
            if held_after - held_before - set(coming) != back:
                raise ValueError("the layout must restore exactly the tokens taken back that no layer held")
        if live_brightness is not None and len(live_brightness) != len(live):
            raise ValueError(f"{len(live_brightness)} brightness values for {len(live)} live rows")
        if (ring is None) != (self.ring is None):
            raise ValueError("a ring store's edit brings the ring after it, and only a ring store's")
        if ring is not None and layout.length > ring.capacity:
            raise ValueError(f"{layout.length} rows do not fit a ring of {ring.capacity} slots")
        if len(texts) != len(layout.new_token_ids):
            raise ValueError(f"{len(texts)} texts for {len(layout.new_token_ids)} new tokens")
        for insertion, _ in layout.groups:
            if insertion.source not in SOURCES:
                raise ValueError(f"unknown token source {insertion.source!r}; expected one of {SOURCES}")
            if not set(insertion.replaces) <= set(layout.deleted):
                raise ValueError(f"rows {insertion.replaces} are replaced but not deleted")
            for ledger_id, token_id in zip(insertion.restores, insertion.token_ids):
                if not 0 <= ledger_id < len(self.ledger) or self.ledger[ledger_id].token_id != token_id:
                    raise ValueError(f"ledger id {ledger_id} does not hold token {token_id}")
            if insertion.restores and len(insertion.restores) != len(insertion.token_ids):
                raise ValueError("a restoring insertion names one ledger id per token")
        # the undo log: everything below changes only the live rows' entries and appends. Every
        # live (or restored) entry may get a new brightness; only the deleted and the restored
        # ones change more (state, death, position, replacement): a tick deletes a row or two
        # of ~300, so the log keeps one float per row and the whole record of those few
        ledger_length = len(self.ledger)
        entries = self.ledger.entries
        restored = [i for insertion, _ in layout.groups for i in insertion.restores]
        touched = list(live) + restored
        brightness_before = [entries[i].brightness for i in touched]
        changed = [live[row] for row in layout.deleted] + restored
        before = [(e.state, e.tick_died, e.replaced_by, e.position, e.resurrections) for e in (entries[i] for i in changed)]
        old_live, old_layers, old_ring = self.live, self.layers, self.ring
        try:
            new_ids = self._splice(layout, texts, tick, brightness, live_brightness)
            if layers_after is not None:
                if (added := [i for i in new_ids if i not in back]) != coming:
                    raise MirrorInvariantError(f"the ledger gave the appended tokens ids {added[:5]}, not {coming[:5]}")
                self.layers = layers_after
            self.ring = ring
            return new_ids
        except BaseException:  # a failure (or Ctrl-C) half-way: the mirror is as it was
            self.live, self.layers, self.ring = old_live, old_layers, old_ring
            self.ledger.truncate(ledger_length)
            for ledger_id, value in zip(touched, brightness_before):
                entries[ledger_id].brightness = value
            for ledger_id, fields in zip(changed, before):
                entry = entries[ledger_id]
                entry.state, entry.tick_died, entry.replaced_by, entry.position, entry.resurrections = fields
            raise

    def _splice(self, layout: Layout, texts: list[str], tick: int, brightness: float,
                live_brightness: list[float] | None) -> list[int]:
        live = self.live.ledger_ids
        if live_brightness is not None:
            self.set_brightness(live_brightness)
        positions = self.live.positions
        for row in layout.deleted:
            self.ledger.retire(live[row], tick, positions[row])
        new_ids = []
        for insertion, part in layout.groups:
            start = max((self.ledger[live[row]].brightness for row in insertion.replaces), default=brightness)
            for ledger_id in insertion.restores:
                self.ledger.resurrect(ledger_id, brightness)
            new_ids += insertion.restores or [self.ledger.add(token_id, text, insertion.source, tick, start)
                                              for token_id, text in zip(insertion.token_ids, texts[part])]
        for insertion, part in layout.groups:
            if insertion.replaces:
                self.ledger.link_replacement([live[row] for row in insertion.replaces], new_ids[part])
        rows: list[int] = [0] * layout.length
        for old, new, count in layout.kept:
            rows[new : new + count] = live[old : old + count]
        for row, ledger_id in zip(layout.new_rows, new_ids):
            rows[row] = ledger_id
        self.live = LiveMap(rows, list(layout.positions))
        return new_ids

    # --- reads --------------------------------------------------------------------------

    def live_token_ids(self) -> list[int]:
        entries = self.ledger.entries
        return [entries[i].token_id for i in self.live.ledger_ids]

    def live_texts(self) -> list[str]:
        entries = self.ledger.entries
        return [entries[i].text for i in self.live.ledger_ids]

    def positions(self) -> list[int]:
        return list(self.live.positions)

    def brightness(self) -> list[float]:
        entries = self.ledger.entries
        return [entries[i].brightness for i in self.live.ledger_ids]

    def set_pinned(self, rows: list[int], pinned: bool) -> None:
        """Pin (or unpin) live rows: a pinned row is never evicted or repaired."""
        if bad := [row for row in rows if not 0 <= row < len(self.live)]:
            raise ValueError(f"rows {bad} out of range 0..{len(self.live) - 1}")
        for row in rows:
            self.ledger.entries[self.live.ledger_ids[row]].pinned = pinned

    def set_brightness(self, values: list[float]) -> None:
        """Store one brightness per live row (Step 2b's output)."""
        if len(values) != len(self.live):
            raise ValueError(f"{len(values)} brightness values for {len(self.live)} live rows")
        entries = self.ledger.entries
        for ledger_id, value in zip(self.live.ledger_ids, values):
            entries[ledger_id].brightness = float(value)

    # --- invariants ---------------------------------------------------------------------

    def check(self, max_position: int | None = None) -> None:
        """Raise MirrorInvariantError unless the mirror describes a consistent context.

        Checked: one position per row; positions strictly increasing, >= 0 and below
        `max_position`; every live row names a distinct, existing, live ledger entry and
        every live ledger entry is in the live map; brightness is finite; dead entries carry
        their tick of death and replaced entries name existing replacements.
        """
        live, entries = self.live, self.ledger.entries
        if len(live.ledger_ids) != len(live.positions):
            raise MirrorInvariantError(f"{len(live.ledger_ids)} live rows but {len(live.positions)} positions")
        previous = -1
        for row, position in enumerate(live.positions):
            if position <= previous:
                raise MirrorInvariantError(f"RoPE positions not strictly increasing at row {row}: {previous} then {position}")
            previous = position
        if live.positions and live.positions[0] < 0:
            raise MirrorInvariantError(f"negative RoPE position {live.positions[0]}")
        if max_position is not None and previous >= max_position:
            raise MirrorInvariantError(f"RoPE position {previous} beyond the model's limit {max_position}")
        if len(set(live.ledger_ids)) != len(live.ledger_ids):
            raise MirrorInvariantError("a ledger id appears twice in the live map")
        for row, ledger_id in enumerate(live.ledger_ids):
            if not 0 <= ledger_id < len(entries):
                raise MirrorInvariantError(f"row {row} names ledger id {ledger_id}, which does not exist")
            if entries[ledger_id].state != LIVE:
                raise MirrorInvariantError(f"row {row} holds ledger id {ledger_id}, which is {entries[ledger_id].state}")
        live_count = 0
        for ledger_id, entry in enumerate(entries):
            if not math.isfinite(entry.brightness):  # NaN would never be culled, inf never kept
                raise MirrorInvariantError(f"ledger id {ledger_id} has brightness {entry.brightness}")
            if entry.state == LIVE:
                live_count += 1
            elif entry.state in (CULLED, REPLACED):
                if entry.tick_died is None:
                    raise MirrorInvariantError(f"ledger id {ledger_id} is {entry.state} but has no tick of death")
                if entry.state == REPLACED and (
                    not entry.replaced_by or not all(0 <= r < len(entries) for r in entry.replaced_by)
                ):
                    raise MirrorInvariantError(f"ledger id {ledger_id} is replaced but names no valid replacement")
            else:
                raise MirrorInvariantError(f"ledger id {ledger_id} has unknown state {entry.state!r}")
        if live_count != len(live):
            raise MirrorInvariantError(f"ledger has {live_count} live tokens but the live map has {len(live)} rows")
        for ledger_id in live.ledger_ids:
            if entries[ledger_id].position is not None:
                raise MirrorInvariantError(f"ledger id {ledger_id} is live but carries the position of a dead token")
        if self.layers is not None:
            try:
                self.layers.check(live.ledger_ids)
            except LayerRowsError as exc:
                raise MirrorInvariantError(f"per-layer rows: {exc}") from None
        if self.ring is not None:
            if not isinstance(self.ring, Ring):
                raise MirrorInvariantError(f"the ring must be a Ring, got {type(self.ring).__name__}")
            if len(live) > self.ring.capacity:
                raise MirrorInvariantError(f"{len(live)} live rows do not fit the ring's {self.ring.capacity} slots")
            if self.layers is not None:
                raise MirrorInvariantError("a ring store keeps the same rows in every layer: no per-layer rows")

    # --- per-layer rows (a per-layer policy) ----------------------------------------------

    def layer_positions(self, layer: int) -> list[int]:
        """The RoPE position of each row of `layer`'s cache (every layer's rows, without per-layer rows)."""
        if self.layers is None:
            return list(self.live.positions)
        where = dict(zip(self.live.ledger_ids, self.live.positions))
        return [where[ledger_id] for ledger_id in self.layers.rows[layer]]

    def layer_rows_of(self, layer: int) -> list[int]:
        """The union (live-map) row each row of `layer`'s cache holds."""
        if self.layers is None:
            return list(range(len(self.live)))
        where = {ledger_id: row for row, ledger_id in enumerate(self.live.ledger_ids)}
        return [where[ledger_id] for ledger_id in self.layers.rows[layer]]

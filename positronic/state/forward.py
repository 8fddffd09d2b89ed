"""Every model forward the brain makes goes through `forward()`; attention is SDPA.

Three choices make a forward over an edited cache correct:
- explicit `position_ids`: rows carry recorded RoPE positions with gaps, so positions can
  never be inferred from the cache length;
- a mask built from positions, not row numbers: a query at position p sees exactly the rows
  whose position is <= p. Live positions increase with the row, so for a prefill this is the
  causal mask, and for a tick's forward it gives each inserted token its own left context
  (the rows to its right, old or new, are hidden) while the new last token sees everything;
- the new rows' K/V are written by the model itself, through `Cache.update`: after the live
  rows (append) or into the gaps a splice opened (`SpliceCache.fill`).

A ring store (kv.ring.RingLayer) gives the model its rows in slot order, not row order: the
mask is then laid out by slot (`slot_rows`), free slots hidden from every query, and the
attention row is read back in row order. The newest token alone (a tick's forward) sees every
live row, and its attention does not depend on their order: it needs no mask at all, or,
after a batch eviction left free slots, one that hides their single run (`Ring.free`, two
tensor ops: no slot map is built for it).

The attention row that brightness and the eviction policies read is not taken from
`output_attentions` (which forces eager attention in every layer): `AttentionRow` taps the
scored layers' query and computes softmax(q·Kᵀ / √d) for the last fed token only.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from ..kv.cache import SpliceCache
from ..models import attention
from ..models.compat import with_cache
from ..models.lean import logits_of

# the batch this sequence ticks in (positronic.batch.Rounds, set inside its works; None: alone):
# its forwards, prefill chunks included, meet the other sequences' and run as one
MEETING: contextvars.ContextVar = contextvars.ContextVar("positronic_meeting", default=None)
# the caches a batched forward is writing (ids; None outside one): a fault armed by one
# sequence fires only in a forward that feeds that sequence
FEEDING: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("positronic_feeding", default=None)
PREFILL_CHUNK = 512  # query rows per forward when (re)building; bounds the mask and the logits
HIDDEN = torch.iinfo(torch.long).max  # the key position of a free ring slot: no query sees it


@dataclass
class ForwardResult:
    """predicted: [n] int64, the greedy next token after each fed token (argmax of its logits).
    logits: [vocab] float32, the newest fed token's next-token logits.
    attention: [scored layers, heads, rows] float32, the newest token's attention over every
    cache row (None unless asked for).
    query: [scored layers, heads, head_dim] float32, that token's query, rotated at its
    position and multiplied by the attention scaling: query · key is the logit a key rotated
    at its own position would get (recall scores evicted keys with it).
    log_norm: [scored layers, heads] float32, log Σ exp(logits) over the cache rows: the
    would-be attention of another key is exp(query · key - log_norm).
    probe_logprobs: [probes] float32, log P(probe target | the probe's context), see `Probes`."""

    predicted: torch.Tensor
    logits: torch.Tensor
    attention: torch.Tensor | None
    probe_logprobs: torch.Tensor | None = None
    query: torch.Tensor | None = None
    log_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class Probes:
    """Scratch queries that ride along in a forward: what would the model predict after
    token t placed at position p, given only the rows left of p? Each probe is fed after the
    real tokens, writes its K/V into a scratch row past the live rows (which the caller then
    discards), sees only the rows whose position is below its own (and itself), and is seen
    by nobody. token_ids, positions, targets: [probes] each; the forward returns
    log P(target | context, token)."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    targets: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.token_ids)


def visibility_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype, *,
                    probes: int = 0) -> torch.Tensor:
    """Additive mask [1, 1, queries, keys]: 0 where key position <= query position, else -inf-ish.

    probes: the last `probes` queries are probes and the last `probes` keys their scratch rows
    (in the same order): no query sees a scratch row but its own probe, and a probe sees
    only the rows strictly left of its position (the row it stands in for is hidden)."""
    hidden = key_positions[None, :] > query_positions[:, None]
    if probes:
        queries, keys = hidden.shape
        hidden[:, keys - probes:] = True
        probe_hidden = key_positions[None, :] >= query_positions[queries - probes:, None]
        hidden[queries - probes:] |= probe_hidden
        own = torch.arange(probes, device=hidden.device)
        hidden[queries - probes + own, keys - probes + own] = False
    mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return mask.masked_fill_(hidden, torch.finfo(dtype).min)[None, None]


def hidden_slots(used: int, free: range, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, 1, used] for one query that sees every used slot but the `free` ones."""
    mask = torch.zeros((1, 1, 1, used), dtype=dtype, device=device)
    mask[..., free.start : free.stop] = torch.finfo(dtype).min
    return mask


class AttentionRow:
    """Records the last fed token's attention over every cache row on the chosen layers.

    While `record()` is active, the attention tap (models/attention.py) keeps that token's
    query in each chosen layer, exactly as the model attends with it: after the family's own
    projections, norms and RoPE (`Seen`). After the forward, `finish` takes softmax(q·Kᵀ ·
    scaling) against each layer's keys, all layers in one batched product. The token must see
    every row (it is the newest), so no mask applies. Doing the work inside the forward, one
    layer at a time, cost ~1 ms per layer on a CPU (a dozen small ops each); batched it is a few.
    Without `weights` the attention kernel's own log-normaliser is taken where it gives one, and
    no key is read again.
    """

    def __init__(self, model, layers: list[int], *, query: int = -1, keys: int | None = None,
                 slots: torch.Tensor | None = None, weights: bool = True):
        self.model, self.layers = model, list(layers)
        self.query, self.keys = query, keys  # which fed token; how many leading cache rows it attends
        self.slots = slots  # a ring store: the slot of each of those rows (their keys lie in slot order)
        self.weights = weights  # the attention row itself; else only the query and its log-normaliser
        self.seen: Seen | None = None  # what the forward's tap kept, for this recorder and the others of the forward
        self.column = 0  # this recorder's column in `seen`
        self.rows = self.queries = self.log_norms = None

    @contextlib.contextmanager
    def record(self, cache=None):
        with recording([self]):
            yield self
        if cache is not None and self.layers:
            self.finish(cache)

    def at(self, tokens: int) -> int:
        """The recorded token's index among the forward's `tokens` fed tokens."""
        return self.query if self.query >= 0 else tokens + self.query

    @torch.no_grad()
    def finish(self, cache) -> None:
        """rows [layers, heads, rows] (None unless `weights`), queries [layers, heads, head_dim]
        (scaled), log_norms [layers, heads], all float32, in the order of `layers`."""
        seen = self.seen
        missing = [index for index in self.layers if seen is None or index not in seen.queries]
        if missing:
            raise RuntimeError(f"layers {missing} did not call the attention function: the model must run "
                               f"{attention.ATTENTION!r} or {attention.ATTENTION_CUDA!r}")
        queries, norms = seen.stacked(tuple(self.layers))
        query = queries[:, :, self.column]  # [layers, heads, d]
        scaled = query.float() * seen.scaling  # [L, heads, d]
        if not self.weights and norms is not None:
            # the kernel's normalisers: no key is read again (1 ms of a CPU tick for SmolLM2's 30 layers)
            self.rows, self.queries = None, scaled
            self.log_norms = norms[:, :, self.column].contiguous()
            return
        if self.slots is None:
            keys = cache.layer_keys(self.layers, self.keys)  # [L, kv, rows, d]
        else:  # the used slots as they lie (no gather of every row); the scores are then put in row order
            used = cache.ring.used(self.keys)
            keys = torch.stack([cache.layers[index].key_buffer[0, :, :used] for index in self.layers])
        layers, _, rows, _ = keys.shape
        # [L, heads, rows or slots]
        scores = attention.grouped_logits(scaled, keys.transpose(-1, -2)).reshape(layers, -1, rows)
        if self.slots is not None:
            scores = scores.index_select(-1, self.slots)  # free slots drop out here
        self.rows = scores.softmax(dim=-1)
        self.queries = scaled
        self.log_norms = scores.logsumexp(dim=-1)

    def result(self) -> torch.Tensor:
        """[layers, heads, rows] float32, in the order of `layers`."""
        return self.rows

    def scaled_query(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scaled query [layers, heads, head_dim] and log-normaliser [layers, heads]."""
        return self.queries, self.log_norms


class Seen:
    """What one forward's attention tap kept for its recorders, all at once: per recorded
    layer, each recorder's token's query [heads, recorders, head_dim] and, where the kernel
    gave it, its log-normaliser [heads, recorders]. One pick per layer for every recorder (a
    batched forward records a token of each sequence), not one per recorder."""

    def __init__(self, recorders: list[AttentionRow]):
        self.recorders = recorders
        self.queries: dict[int, torch.Tensor] = {}
        self.norms: dict[int, torch.Tensor] = {}
        self.scaling: float | None = None
        self._columns: torch.Tensor | None = None
        self._stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def columns(self, tokens: int, device) -> torch.Tensor:
        """int64 [recorders]: each recorder's token among the forward's `tokens` (made once)."""
        if self._columns is None:
            self._columns = torch.tensor([recorder.at(tokens) for recorder in self.recorders], device=device)
        return self._columns

    def see(self, module, query, key, value, scaling) -> None:
        """query [1, heads, tokens, head_dim]"""
        self.queries[module.layer_idx] = query[0].detach().index_select(1, self.columns(query.shape[2], query.device))
        self.scaling = scaling

    def norm(self, module, log_norm: torch.Tensor) -> None:
        """log_norm [1, heads, tokens]"""
        self.norms[module.layer_idx] = log_norm[0].index_select(1, self.columns(log_norm.shape[2], log_norm.device))

    def stacked(self, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """queries [layers, heads, recorders, head_dim], and log-normalisers [layers, heads,
        recorders] if the kernel gave them on every one of `layers` (else None)."""
        if layers not in self._stacked:
            norms = None
            if all(index in self.norms for index in layers):
                norms = torch.stack([self.norms[index] for index in layers])
            self._stacked[layers] = torch.stack([self.queries[index] for index in layers]), norms
        return self._stacked[layers]


@contextlib.contextmanager
def recording(recorders: list[AttentionRow]):
    """While active, the recorders' tokens' queries are kept (several in one forward: a batched
    one records each sequence's newest token), in one `Seen` they share."""
    active = [recorder for recorder in recorders if recorder.layers]
    seen = Seen(active)
    for recorder in recorders:
        recorder.seen = seen
    for column, recorder in enumerate(active):
        recorder.column = column
    if not active:
        yield
        return
    with attention.tap(seen.see, {layer for recorder in active for layer in recorder.layers}, norms=seen.norm):
        yield


@dataclass
class Prepared:
    """One sequence's part of a forward, ready to run: what the model is fed (`token_ids` then
    the probes', at `query` positions [n + probes]), the mask over its cache rows (None: every
    query sees every row), and the recorder of its newest token's attention row."""

    cache: SpliceCache
    token_ids: list[int]
    fed: int  # the real tokens (the probes come after them)
    query: torch.Tensor
    mask: torch.Tensor | None
    recorder: AttentionRow
    probes: Probes
    filling: bool = False  # the cache writes into rows its splice opened (not appended)

    def __post_init__(self):
        # rows an append writes: taken back before the forward runs again (`undo_appends`)
        self.lengths = None if self.filling else [layer.length for layer in self.cache.layers]

    def undo_appends(self) -> None:
        """Take back the rows a failed forward appended (rows it wrote into gaps need nothing:
        running it again writes them again)."""
        if self.lengths is not None:
            for layer, length in zip(self.cache.layers, self.lengths):
                if layer.length > length:
                    layer.crop(length - layer.length)

    def place(self, first: int) -> None:
        """Its tokens start at `first` among the tokens of the forward (a batched one)."""
        self.recorder.query = first + self.fed - 1

    def result(self, logits: torch.Tensor) -> ForwardResult:
        """logits [fed + probes, vocab] of this sequence -> its ForwardResult (the recorder finished)."""
        probe_logprobs = None
        if self.probes:
            targets = torch.tensor(self.probes.targets, dtype=torch.long, device=logits.device)
            scored = logits[self.fed:].float().log_softmax(dim=-1)
            probe_logprobs = scored.gather(1, targets[:, None])[:, 0].cpu()
        recorded = bool(self.recorder.layers)
        query, log_norm = self.recorder.scaled_query() if recorded else (None, None)
        return ForwardResult(predicted=logits[: self.fed].argmax(dim=-1).cpu(), logits=logits[self.fed - 1].float(),
                             attention=self.recorder.result() if recorded else None, probe_logprobs=probe_logprobs,
                             query=query, log_norm=log_norm)


def prepare(lm, cache: SpliceCache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
            attention_layers: list[int] | None = None, probes: Probes | None = None, weights: bool = True) -> Prepared:
    """Check a forward's arguments (see `forward`) and build its positions and mask (a
    batched forward then places its tokens among the others': `Prepared.place`)."""
    if len(token_ids) != len(positions) or not token_ids:
        raise ValueError("forward needs one position per token, and at least one token")
    probes = probes or Probes((), (), ())
    device = lm.device
    query = torch.tensor(list(positions) + list(probes.positions), dtype=torch.long, device=device)
    newest = positions[-1] == max(key_positions)
    if attention_layers and not newest:
        raise ValueError("the attention row is recorded for the newest row only")
    slots = None
    if getattr(cache, "store", "splice") == "ring":
        if probes:
            raise ValueError("probes need the splice store: a ring keeps no scratch rows")
        if len(key_positions) > cache.ring.capacity:
            raise ValueError(f"{len(key_positions)} rows do not fit the ring's {cache.ring.capacity} slots: "
                             "reserve them before the forward")
        slots = cache.slot_index(len(key_positions)).to(device) if attention_layers else None
        if len(token_ids) == 1 and newest:  # it sees every live row: only the free slots need hiding
            free = cache.ring.free(len(key_positions))
            mask = hidden_slots(cache.ring.used(len(key_positions)), free, lm.dtype, device) if free else None
        else:
            order = cache.slot_rows(len(key_positions)).to(device)  # the model sees the keys in this order
            keys = _key_positions(key_positions, probes, device)[order.clamp(min=0)].masked_fill(order < 0, HIDDEN)
            mask = visibility_mask(query, keys, lm.dtype)
    elif len(token_ids) == 1 and newest and not probes:
        mask = None  # the newest token sees every row: no mask, so no key positions to copy to the device
    else:
        mask = visibility_mask(query, _key_positions(key_positions, probes, device), lm.dtype, probes=len(probes))
    recorder = AttentionRow(lm.model, attention_layers or [], query=len(token_ids) - 1,
                            keys=len(key_positions), slots=slots, weights=weights)
    return Prepared(cache, list(token_ids) + list(probes.token_ids), len(token_ids), query, mask, recorder, probes,
                    filling=bool(getattr(cache, "filling", False)))


def _key_positions(key_positions: list[int], probes: Probes, device) -> torch.Tensor:
    """int64 [rows + probes]: each cache row's position, then the probes' scratch rows'."""
    return torch.tensor(list(key_positions) + list(probes.positions), dtype=torch.long, device=device)


@torch.no_grad()
def forward(lm, cache: SpliceCache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
            attention_layers: list[int] | None = None, probes: Probes | None = None,
            weights: bool = True) -> ForwardResult:
    """Feed `token_ids` at RoPE `positions` through the model over `cache`.

    key_positions: the position of every cache row once this forward has written its rows
    (the live rows after an append, or the whole spliced layout). The new rows are appended,
    or written into the rows the caller opened with `cache.fill(rows)`. `attention_layers`:
    record the newest token's attention row on these layers; it must be the newest row.
    `weights` False: only its query and log-normaliser (`ForwardResult.attention` is None),
    which the CPU's attention kernel gives without reading the keys again.
    `probes` are fed after `token_ids`; their scratch rows come after the live rows (the
    caller opens them with `fill` and drops them afterwards), their positions after
    `key_positions`.

    Where one sequence of a batch ticks (`MEETING` set: a greenlet of `batch.Rounds`), the
    forward is shared with the other sequences' (the same result, one model run for all).
    """
    meeting = MEETING.get()
    if meeting is not None:  # this sequence ticks in a batch: one forward for all of it
        return meeting.forward(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                               probes=probes, weights=weights)
    return forward_alone(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers,
                         probes=probes, weights=weights)


@torch.no_grad()
def forward_alone(lm, cache: SpliceCache, token_ids: list[int], positions: list[int], key_positions: list[int], *,
                  attention_layers: list[int] | None = None, probes: Probes | None = None,
                  weights: bool = True) -> ForwardResult:
    """`forward` in a model forward of its own, whatever batch this thread is in."""
    part = prepare(lm, cache, token_ids, positions, key_positions, attention_layers=attention_layers, probes=probes,
                   weights=weights)
    ids = torch.tensor([part.token_ids], dtype=torch.long, device=lm.device)
    with part.recorder.record(cache):
        logits = logits_of(lm.model, ids, part.query[None], cache, part.mask)
    return part.result(logits[0])


def prefill(lm, cache: SpliceCache, token_ids: list[int], positions: list[int], *,
            attention_layers: list[int] | None = None, weights: bool = True) -> ForwardResult:
    """Append a long span in chunks (positions increasing). Returns every token's greedy
    prediction, and the last token's logits and attention row."""
    if cache.length:
        raise ValueError("prefill starts from an empty cache")
    predicted, result = [], None
    meeting = MEETING.get()
    chunk = PREFILL_CHUNK if meeting is None else meeting.prefill_chunk  # in a batch: hold the others up less
    for start in range(0, len(token_ids), chunk):
        stop = min(start + chunk, len(token_ids))
        last = stop == len(token_ids)
        result = forward(lm, cache, token_ids[start:stop], positions[start:stop], positions[:stop],
                         attention_layers=attention_layers if last else None, weights=weights)
        predicted.append(result.predicted)
    return ForwardResult(torch.cat(predicted), result.logits, result.attention, query=result.query,
                         log_norm=result.log_norm)


@torch.no_grad()
def fresh_layer0_kv(lm, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K/V computed from scratch: they depend only on token and position.

    The model's own first decoder layer's norm and attention write them into a scratch
    DynamicCache (whatever the family's projections, biases and norms); its MLP and the rest of
    the model are not run (the MLP was 60% of the time, for nothing: a recall checks up to 16
    rows a tick with this). Every proven family's layer starts with `input_layernorm` then
    `self_attn` (models/checks.py FAMILIES).
    Returns keys, values: [1, kv_heads, rows, head_dim] in the model's dtype — what a fresh
    prefill of `token_ids` at `positions` would store in layer 0.
    """
    from transformers import DynamicCache

    model = lm.model.model
    ids = torch.tensor([token_ids], dtype=torch.long, device=lm.device)
    pos = torch.tensor([positions], dtype=torch.long, device=lm.device)
    hidden = model.embed_tokens(ids)
    scratch = DynamicCache()  # no config: a sliding-window model's would keep only its window
    mask = visibility_mask(pos[0], pos[0], hidden.dtype)  # only K/V are read; any valid mask does
    layer = model.layers[0]
    layer.self_attn(layer.input_layernorm(hidden), attention_mask=mask, position_ids=pos,
                    position_embeddings=model.rotary_emb(hidden, pos), use_cache=True, **with_cache(scratch))
    return scratch.layers[0].keys, scratch.layers[0].values

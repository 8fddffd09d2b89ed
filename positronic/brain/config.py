"""A run's settings: typed parts, each with its defaults and its own checks, and the one flat
record (`BrainConfig`) that the CLI, the server and saved sessions speak.

The parts are where a setting is defined: its default lives on the part, `BrainConfig`'s field of
the same name takes it from there, and the part's `check` raises ValueError naming the first bad
value. Rules that tie settings of different parts together (a ring store needs the streaming
policy; a repairer needs pairs; the budget must leave rows to evict) are in `BrainConfig.validate`
and nowhere else. `validate` is the one check of every config, a new one (the CLI's options, the
server's) and one read back from a saved session alike: it raises ConfigError naming the field.
The record stays flat because it is a wire format: sessions saved by earlier versions hold
exactly these names, and `BrainConfig(**saved)` must keep reading them.

    config = BrainConfig(policy="streaming", budget=256, temperature=0)
    config.sampling   # Sampling(temperature=0, top_k=50, top_p=0.95, ...), frozen
    config.memory     # Memory(budget=256, sinks=4, protect=0, window=..., ...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from positronic import steps

from ..kv import formats as kv_formats
from ..kv.cache import check_store
from ..policies import repairers
from ..policies import DEFAULT_WINDOW, POLICIES, reads_window, window_refusal

# a penalty divides (or multiplies) a logit: past these, one token's logit leaves every other
# token's behind by more than float16 can hold, and the setting only means "never" or "always"
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_LIMIT = 2.0  # presence and frequency penalties: OpenAI's range
BIAS_LIMIT = 100.0  # a logit bias: OpenAI's range (-100 bans a token, 100 all but forces it)
MEMORY_RANKS = ("gates", "recent")  # smartkv: how a lane's memory ranks its rows (smartkv/policy.py, MEMORY_RANKS)
MAX_REPAIR_TOKENS = 16  # a repair that proposes more frees nothing anyway; bounds a tick's forward
# every integer setting fits torch's int64 and Python's ssize_t: a budget of 2**64 was an
# OverflowError deep in a policy's check (len of a range), not a refusal
INT_LIMIT = 2**63

# The budget's default, per entry point (one place, three audiences): the library keeps the
# design's reference budget; a first `run` is small so that maintenance is at work within its
# 300 ticks; a served conversation needs more room than a demo.
BUDGET = 500
RUN_BUDGET = 128
SERVE_BUDGET = 512


def parse_logit_bias(text: str) -> dict[int, float]:
    """{token id: bias} from "ID:BIAS,ID:BIAS" (the form a BrainConfig keeps: a session saves
    it as a string); ValueError naming an entry that is not an id >= 0 with a bias in
    [-100, 100], or an id given twice."""
    bias: dict[int, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        token, _, value = entry.partition(":")
        try:
            token_id, amount = int(token), float(value)
        except ValueError:
            raise ValueError(f"logit_bias entry {entry!r} is not ID:BIAS") from None
        if token_id < 0 or not -BIAS_LIMIT <= amount <= BIAS_LIMIT or token_id in bias:
            raise ValueError(f"logit_bias entry {entry!r}: the id must be >= 0 and given once, the bias in "
                             f"[-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]")
        bias[token_id] = amount
    return bias


def logit_bias_text(bias: dict[int, float]) -> str:
    """The BrainConfig form of {token id: bias}: sorted, so equal biases are equal strings."""
    return ",".join(f"{token}:{amount!r}" for token, amount in sorted(bias.items()))


class ConfigError(ValueError):
    """A setting that cannot run: `field` names it (the first bad one found); the message says
    why, and starts with the field's name ("top_p must be …", "kv_format: unknown …") where it
    is about that field alone, so that a caller can write it as its own name for the field (the
    CLI's --top-p, a session file's "setting top_p")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _nonnegative(part, *names: str) -> None:
    for name in names:
        if getattr(part, name) < 0:
            raise ConfigError(name, f"{name} must be >= 0, got {getattr(part, name)}")


def _finite_nonnegative(part, *names: str) -> None:
    for name in names:
        if not (getattr(part, name) >= 0 and math.isfinite(getattr(part, name))):
            raise ConfigError(name, f"{name} must be a finite number >= 0, got {getattr(part, name)}")


def _checked(field: str, check, value) -> None:
    """`check(value)` (another module's ValueError) as a ConfigError naming `field`."""
    try:
        check(value)
    except ValueError as exc:
        message = str(exc)
        raise ConfigError(field, message if message.startswith(field) else f"{field}: {message}") from None


class Part:
    """A frozen group of settings, built from (and checked for) a BrainConfig."""

    @classmethod
    def of(cls, config: "BrainConfig"):
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def check(self) -> None:
        """Raise ValueError naming the first bad setting of this part."""


@dataclass(frozen=True)
class Sampling(Part):
    """Step 1: how the next token is drawn (temperature <= 1e-3 is greedy)."""

    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.95
    repetition_penalty: float = 1.1
    penalty_window: int = 64  # recent tokens the penalties look at
    seed: int = 0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the top one (0 = off)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from a token in the penalty window
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the penalty window
    logit_bias: str = ""  # "ID:BIAS,ID:BIAS" (logit_bias_text), added to those tokens' logits

    @property
    def bias(self) -> dict[int, float]:
        """logit_bias as {token id: bias}."""
        return parse_logit_bias(self.logit_bias)

    def check(self) -> None:
        _nonnegative(self, "top_k", "penalty_window")
        _finite_nonnegative(self, "temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ConfigError(name, f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], "
                                        f"got {getattr(self, name)}")
        _checked("logit_bias", parse_logit_bias, self.logit_bias)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # NaN fails too
            raise ConfigError("repetition_penalty", f"repetition_penalty must be in [{low}, {high}] (1 = off), "
                                                    f"got {self.repetition_penalty}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError("seed", f"seed must be in 0..2**63-1, got {self.seed}")


@dataclass(frozen=True)
class Memory(Part):
    """The live context: its budget, the rows no policy may evict, how rows are scored and
    stored, and when the cache is rebuilt from the mirror."""

    budget: int = BUDGET  # target live length: never exceeded after a tick
    sinks: int = 4  # attention-sink rows never culled
    protect: int = 0  # protected prefix (e.g. a system prompt), counted from row 0
    window: int | None = None  # most recent rows never culled; None: the policy's default
    score_layers: str | list[int] = "last"  # which layers' attention scores a row
    # evicted chunks come back when the newest token's query matches them (positronic/policies/recall.py)
    recall: bool = False
    kv_format: str = "float"  # cache rows: float (the model's dtype) | int4 | fp4 | int4h (positronic/kv/formats.py)
    kv_store: str = "splice"  # where rows live: splice (one window of a buffer) | ring (streaming only)
    refresh_every: int = 0  # rebuild the cache from the mirror every N ticks (0 = never)
    refresh_kl: float = 0.0  # or: every 50 ticks measure KL(fresh ‖ spliced); rebuild above this (0 = off)
    # The shared-row policies edit once every N ticks, freeing N rows (the live length moves
    # between budget - N + 1 and budget: the budget stays hard). 0: each policy's own schedule,
    # llama.cpp's budget // 16 + 1 (brightness: repair_batch). SmartKV drops one memory row per
    # lane every tick and none shifts half its rows: neither takes it.
    evict_every: int = 0

    def check(self) -> None:
        _nonnegative(self, "sinks", "protect", "window", "refresh_every", "evict_every")
        _finite_nonnegative(self, "refresh_kl")  # inf would measure every 50 ticks and never rebuild
        _checked("kv_format", kv_formats.check_format, self.kv_format)
        _checked("kv_store", check_store, self.kv_store)


@dataclass(frozen=True)
class Brightness(Part):
    """The brightness policy's scorer and eviction units."""

    # ttl: b <- clamp(b - decay + gain * score, 0, 255). The ratio gain/decay is what matters:
    # at 500 a row holds its brightness while it gets about its fair share of attention
    # (1/live at a budget of 256 rows) and fades otherwise. The design's reference constants
    # (2, 10) make attention almost irrelevant; 500 measured best (bench/results/history/policies.md).
    brightness: str = "ttl"  # rule: ttl | vote
    ttl_decay: float = 2.0
    ttl_gain: float = 1000.0
    unit: int = 0  # rows culled together (1 row, 2 pair, n chunk; 0: pairs with a repairer, else rows)
    # Rows freed at once when the budget is reached (1 = one per tick). On a CPU a forward with
    # k new tokens costs about k single-token forwards for k <= 3 and grows slowly after that, so
    # freeing 8 rows every 8th tick costs far less than one every tick
    # (bench/results/history/decode.md, 2026-11-23); the live length then moves between
    # budget - 8 and budget.
    repair_batch: int = 8

    def check(self) -> None:
        if self.brightness not in steps.RULES:
            raise ConfigError("brightness", f"unknown brightness rule {self.brightness!r}; "
                                            f"choose from {', '.join(steps.RULES)}")
        if self.unit < 0:
            raise ConfigError("unit", f"unit must be >= 0 (0: automatic), got {self.unit}")
        _finite_nonnegative(self, "ttl_decay", "ttl_gain")
        if self.repair_batch < 1:
            raise ConfigError("repair_batch", f"repair_batch must be >= 1, got {self.repair_batch}")


@dataclass(frozen=True)
class Repair(Part):
    """What replaces an evicted pair: none (cull only, measured best: every repairer tried costs
    perplexity, bench/results/policies.md) | bridge | self | mlm:PATH."""

    repairer: str = "none"
    repair_tokens: int = 1  # tokens a repairer may propose per pair (self: exactly 1)
    bridge_margin: float = 0.0  # bridge: nats by which keeping a token must beat culling the pair

    def check(self) -> None:
        _checked("repairer", repairers.check_spec, self.repairer)
        _finite_nonnegative(self, "bridge_margin")
        if not 1 <= self.repair_tokens <= MAX_REPAIR_TOKENS:
            raise ConfigError("repair_tokens",
                              f"repair_tokens must be in 1..{MAX_REPAIR_TOKENS}, got {self.repair_tokens}")
        if self.repairer in ("self", "bridge") and self.repair_tokens != 1:
            raise ConfigError("repair_tokens", f"the {self.repairer} repairer proposes exactly 1 token per pair, not "
                                               f"{self.repair_tokens} (--repair-tokens applies to --repairer mlm:PATH)")


@dataclass(frozen=True)
class ContextShift(Part):
    """Policy none: what happens when the cache is full."""

    at_capacity: str = "shift"  # shift (llama.cpp's context shift) | stop

    def check(self) -> None:
        if self.at_capacity not in ("stop", "shift"):
            raise ConfigError("at_capacity", f"at_capacity must be 'stop' or 'shift', got {self.at_capacity!r}")


@dataclass(frozen=True)
class SmartKVGates(Part):
    """Policy smartkv: a gate file (.safetensors); "" = the gates shipped for the model; "auto" =
    those, else gates trained for the model on its first use and kept (smartkv/first_use.py); how a
    lane's memory ranks its rows: by the gates (gates), or by the gates and the attention the
    lane paid each row lately (recent: positronic/smartkv/recent.py). None: the best measured
    for the run, `default_memory_rank` (a BrainConfig resolves it when made)."""

    gates: str = ""
    memory_rank: str | None = None
    # With recall: look right after each forward, with the query it made, and read that token
    # again with what came back (its forward runs once more; the `reread` action), so the token
    # the look was for is predicted with it, not the one after. None: on with recall
    # (`default_reread`); Core v4's rounds do not reread yet (batch/engine.py).
    reread: bool | None = None

    def check(self) -> None:
        if self.memory_rank not in MEMORY_RANKS:
            raise ConfigError("memory_rank", f"memory_rank must be one of {', '.join(MEMORY_RANKS)}, "
                                             f"got {self.memory_rank!r}")


PARTS = (Sampling, Memory, Brightness, Repair, ContextShift, SmartKVGates)
AUTO_GATES = "auto"  # SmartKVGates.gates: shipped gates, else trained on first use (smartkv/first_use.py)


def _check_gate_file(path: str) -> None:
    """ConfigError unless `path` is a regular file, found without opening it (a FIFO named as
    gates cannot block the check) and a missing file told from a directory or a device."""
    from positronic.mirror.storage import regular_file

    try:
        regular_file(path)
    except FileNotFoundError:
        raise ConfigError("gates", f"gates {path} does not exist") from None
    except OSError as exc:
        raise ConfigError("gates", f"gates {path}: {exc.strerror or exc}") from None


# Settings whose None means "the run's default", resolved when a BrainConfig is made (and so
# saved resolved, of this type).
RESOLVED = {"window": int, "memory_rank": str, "reread": bool}


def _kind_ok(name: str, value, default) -> bool:
    """Whether `value` is of the type field `name` holds (a bool is no number here)."""
    if name == "score_layers":
        return value in ("last", "all") or (isinstance(value, list) and all(type(v) is int for v in value))
    if name in RESOLVED:
        return type(value) is RESOLVED[name]
    if type(default) is float:
        return type(value) in (int, float)
    return type(value) is type(default)


def default_memory_rank(policy: str, recall: bool) -> str:
    """The memory rank a run gets when none is asked for: recent for smartkv with recall (the
    best measured: docs/policies.md, "The default"), else gates (smartkv without recall was
    measured with the gates alone; the other policies have no such memory)."""
    return "recent" if recall and policy in POLICIES and POLICIES[policy].per_layer else "gates"


def default_reread(policy: str, recall: bool) -> bool:
    """Whether a run rereads when not asked: smartkv with recall does (its look right after the
    forward: bench/results/policies.md, "Reread"); no other policy has it."""
    return bool(recall and policy in POLICIES and POLICIES[policy].per_layer)


def _default(part: type[Part], name: str):
    return next(f.default for f in fields(part) if f.name == name)


@dataclass
class BrainConfig:
    """Every setting of a run, flat; saved with a session, so resuming needs nothing else.
    Defaults and checks come from the parts above (`sampling`, `memory`, ... return them)."""

    policy: str = "brightness"  # maintenance policy (positronic/policies/)
    at_capacity: str = _default(ContextShift, "at_capacity")
    budget: int = _default(Memory, "budget")
    sinks: int = _default(Memory, "sinks")
    protect: int = _default(Memory, "protect")
    window: int | None = _default(Memory, "window")
    brightness: str = _default(Brightness, "brightness")
    ttl_decay: float = _default(Brightness, "ttl_decay")
    ttl_gain: float = _default(Brightness, "ttl_gain")
    unit: int = _default(Brightness, "unit")
    score_layers: str | list[int] = _default(Memory, "score_layers")
    repairer: str = _default(Repair, "repairer")
    repair_tokens: int = _default(Repair, "repair_tokens")
    bridge_margin: float = _default(Repair, "bridge_margin")
    repair_batch: int = _default(Brightness, "repair_batch")
    temperature: float = _default(Sampling, "temperature")
    top_k: int = _default(Sampling, "top_k")
    top_p: float = _default(Sampling, "top_p")
    repetition_penalty: float = _default(Sampling, "repetition_penalty")
    penalty_window: int = _default(Sampling, "penalty_window")
    seed: int = _default(Sampling, "seed")
    min_p: float = _default(Sampling, "min_p")
    presence_penalty: float = _default(Sampling, "presence_penalty")
    frequency_penalty: float = _default(Sampling, "frequency_penalty")
    logit_bias: str = _default(Sampling, "logit_bias")
    recall: bool = _default(Memory, "recall")
    refresh_every: int = _default(Memory, "refresh_every")
    refresh_kl: float = _default(Memory, "refresh_kl")
    evict_every: int = _default(Memory, "evict_every")
    kv_format: str = _default(Memory, "kv_format")
    kv_store: str = _default(Memory, "kv_store")
    gates: str = _default(SmartKVGates, "gates")
    memory_rank: str | None = _default(SmartKVGates, "memory_rank")
    reread: bool | None = _default(SmartKVGates, "reread")
    # a press's own settings, "name=value,..." (a policy made from a press, policies/pressed.py)
    policy_options: str = ""

    def __post_init__(self):
        if self.window is None:
            policy = POLICIES.get(self.policy)
            self.window = policy.default_window(self.budget) if policy else DEFAULT_WINDOW
        if self.memory_rank is None:
            self.memory_rank = default_memory_rank(self.policy, self.recall)
        if self.reread is None:
            self.reread = default_reread(self.policy, self.recall)

    @property
    def sampling(self) -> Sampling:
        return Sampling.of(self)

    @property
    def memory(self) -> Memory:
        return Memory.of(self)

    @property
    def brightness_rule(self) -> Brightness:
        return Brightness.of(self)

    @property
    def repair(self) -> Repair:
        return Repair.of(self)

    @property
    def recorded_layers(self):
        """Layers whose attention row (and query) each forward records: the scored ones, or
        every layer with recall, whose signal comes from the few heads that look things up,
        wherever they are (the last layer alone does not find an evicted fact), and with a
        memory ranked by recent use (every lane's)."""
        return "all" if self._every_layer else self.score_layers

    @property
    def scored_layers(self):
        """`score_layers`, as an index into the recorded layers."""
        return self.score_layers if self._every_layer else "all"

    @property
    def _every_layer(self) -> bool:
        return self.recall or self.memory_rank != "gates"

    @property
    def unit_rows(self) -> int:
        """Rows per unit: `unit`, or with 0 a pair when a repairer is set, else one row."""
        return self.unit or (1 if self.repairer == "none" else 2)

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first bad setting: each field's type,
        each part's own checks, the bounds every number keeps (integers within int64, floats
        finite), then the rules that tie parts together (the only place such rules live). The
        one check of a config, whether made now or read back from a session."""
        for f in fields(self):
            if not _kind_ok(f.name, getattr(self, f.name), f.default):
                raise ConfigError(f.name, f"{f.name} has the wrong type: {getattr(self, f.name)!r}")
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        for part in PARTS:
            part.of(self).check()
        for f in fields(self):  # what the parts leave unbounded
            value = getattr(self, f.name)
            if type(value) is int and not -INT_LIMIT <= value < INT_LIMIT:
                raise ConfigError(f.name, f"{f.name} must be in -2**63..2**63-1, got {value}")
            if type(value) is float and not math.isfinite(value):
                raise ConfigError(f.name, f"{f.name} must be a finite number, got {value}")
        if not reads_window(self.policy) and self.window != POLICIES[self.policy].default_window(self.budget):
            raise ConfigError("window", window_refusal(self.policy))
        if self.budget < self.sinks + self.window + 4 or self.protect + self.window + 4 > self.budget:
            raise ConfigError("budget", f"budget {self.budget} leaves no room to cull: it must exceed "
                              f"max(sinks, protect) + window + 3 = {max(self.sinks, self.protect) + self.window + 3}")
        if self.kv_store == "ring" and self.policy != "streaming":  # only it evicts the oldest window rows
            raise ConfigError("kv_store", f"the ring store serves only the streaming policy, not {self.policy} "
                                          "(choose --policy streaming or --kv-store splice)")
        if self.kv_store == "ring" and self.kv_format != "float":
            raise ConfigError("kv_store", f"the ring store keeps float rows, not {self.kv_format} "
                                          "(choose --kv-format float or --kv-store splice)")
        evictable = self.budget - max(self.sinks, self.protect) - self.window
        if self.unit > evictable:
            raise ConfigError("unit", f"unit {self.unit} is more rows than the policy can ever cull at budget "
                                      f"{self.budget} (budget - max(sinks, protect) - window = {evictable})")
        if self.repairer != "none" and self.unit not in (0, 2):
            raise ConfigError("repairer", f"the {self.repairer} repairer replaces pairs: it needs unit 2, not "
                                          f"{self.unit} (use --repairer none with other units)")
        if self.gates and not POLICIES[self.policy].per_layer:
            raise ConfigError("gates", f"--gates applies to policy smartkv, not {self.policy}")
        if self.memory_rank != "gates" and not POLICIES[self.policy].per_layer:
            raise ConfigError("memory_rank", f"--memory-rank applies to policy smartkv, not {self.policy}")
        if self.reread and not default_reread(self.policy, True):
            raise ConfigError("reread", f"--reread applies to policy smartkv with recall, not {self.policy}")
        if self.reread and not self.recall:
            raise ConfigError("reread", "--reread rereads a token with what recall brought back: it needs --recall")
        if self.gates and self.gates != AUTO_GATES:
            _check_gate_file(self.gates)
        if self.evict_every:
            self._check_evict_every()
        if self.policy_options:
            self._check_policy_options()
        try:
            POLICIES[self.policy].check(self)  # what the policy needs of the budget, window and repairer
        except ValueError as exc:
            raise ConfigError("budget" if "budget" in str(exc) else "policy", str(exc)) from None

    def _check_policy_options(self) -> None:
        policy = POLICIES[self.policy]
        if not hasattr(policy, "press_class"):
            raise ConfigError("policy_options", f"policy {self.policy} takes no policy options (its settings have "
                                                "flags of their own); they are for policies made from a press")
        try:
            policy.make_press(self)
        except ValueError as exc:
            raise ConfigError("policy_options", str(exc)) from None

    def _check_evict_every(self) -> None:
        policy = POLICIES[self.policy]
        if policy.per_layer or self.policy == "none":
            raise ConfigError("evict_every", f"evict_every applies to the shared-row policies, not {self.policy} "
                                             + ("(it drops one memory row per lane every tick)" if policy.per_layer
                                                else "(it shifts half its rows when full)"))
        free = len(steps.selectable_rows(self.budget, sinks=self.sinks, protect=self.protect,
                                         window=policy.window(self, self.budget)))
        if self.evict_every > free:
            raise ConfigError("evict_every", f"evict_every {self.evict_every} frees more rows at once than policy "
                                             f"{self.policy} can take at budget {self.budget} ({free} evictable rows)")


def check_budget(lm, config: BrainConfig) -> None:
    """ConfigError for settings that cannot run on `lm`, before anything is allocated (a budget
    beyond the model's positions would only fail hundreds of ticks in): `validate`, then what
    needs the model. A new run and a resumed session both pass here."""
    config.validate()
    if config.budget > lm.max_positions:
        raise ConfigError("budget", f"budget {config.budget} is above {lm.name}'s {lm.max_positions} positions")
    if outside := sorted(t for t in config.sampling.bias if t >= lm.vocab_size):
        raise ConfigError("logit_bias", f"logit_bias names token ids {outside} outside {lm.name}'s vocabulary "
                                        f"of {lm.vocab_size}")

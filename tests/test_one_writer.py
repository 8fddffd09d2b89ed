"""One writer: only StateManager changes the KV cache or the mirror.

By construction: `StateManager.mirror` and `.cache` hand out read-only views
(positronic/state/readonly.py), so a write through them raises ReadOnlyError where it is made,
and a tensor read from the cache is a clone. And by a scan: outside the owners (the state
package, the kv package; the top-level mirror package is not scanned), no module

  - calls a method that edits a blade on something reached from a state (`.mirror`, `.cache`),
    aliases included: names assigned from such a path, loop and comprehension variables over it
  - calls an in-place tensor method (`zero_`, `copy_`, ...) on such a thing, or passes it as
    `out=` or as the first argument of an in-place function
  - assigns, augments or deletes an attribute or an item of such a thing, or setattr/delattr's it
  - reaches for a private attribute of it, StateManager's private handles (`_mirror`, `_cache`,
    ...) or a view's (`_target`), or goes round a view with object.__getattribute__/__setattr__

Below, the four writes that used to slip through (an aliased `set_brightness`, an attribute
write, `layer.splice` on a layer reached from the cache, `key_buffer.zero_()` on a tensor from
it) are planted in a scratch module: the scan finds each, and run against a state each is
stopped by the views; with the views taken away, each gets through.
"""

import ast
import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

from positronic import mirror as mirror_pkg
from positronic.brain.loop import Brain, BrainConfig
from positronic.state import readonly
from positronic.state.manager import StateManager
from positronic.state.readonly import CacheView, MirrorView, ReadOnlyError

ROOT = Path(__file__).resolve().parent.parent
MUTATORS = {
    # SpliceCache / its layers
    "splice", "fill", "rotate_keys", "reserve", "crop", "update", "reset", "index_copy_", "set_positions",
    "write_encoded", "splice_heads", "splice_layers", "set_ring", "lazy_initialization", "share_scratch", "hold",
    # Mirror / Ledger / LiveMap
    "set_brightness", "set_pinned", "retire", "resurrect", "truncate", "link_replacement", "add",
}
PRIVATE = {"_mirror", "_cache", "_predicted", "_write_rows", "_target"}
BLADES = {"mirror", "cache"}  # a state's attributes that lead to a blade
# models/lean.py is the model's own forward, run only by the state on a cache it hands over: its
# cache.update is the call transformers' attention makes in the library's forward
OWNERS = ("positronic/state/", "positronic/kv/", "positronic/models/lean.py")
SOURCES = ["positronic", "steps", "bench", "run.py"]


def _in_place(name: str) -> bool:
    """torch's in-place methods: zero_, copy_, index_copy_, add_ (not dunders)."""
    return name.endswith("_") and not name.endswith("__")


class _Scope:
    """The names of one function (or of the module's top level) that hold something reached
    from a state's blade: assigned from a path that starts at `x.mirror` / `x.cache` (or at such
    a name), or iterating over one. Flow-insensitive: a name is tainted for the whole scope."""

    def __init__(self, body: list[ast.AST], inherited: frozenset[str] = frozenset()):
        self.tainted: set[str] = set(inherited)  # a nested function sees its enclosing scope's names
        nodes = [n for statement in body for n in _walk_scope(statement)]
        while True:  # to a fixpoint: `m = state.mirror; live = m.live; ids = live.ledger_ids`
            before = len(self.tainted)
            for node in nodes:
                for target, value in _bindings(node):
                    if self.reached(value):
                        self.tainted |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if len(self.tainted) == before:
                break

    def reached(self, node: ast.AST) -> bool:
        """Whether `node` is a path into a blade: x.mirror, x.cache, a tainted name, or an
        attribute or item of one (a call's result is the callee's: fresh, not a path)."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            if isinstance(node, ast.Attribute) and node.attr in BLADES:
                return True
            node = node.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in BLADES:
            return True
        return isinstance(node, ast.Name) and node.id in self.tainted


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _walk_scope(node: ast.AST):
    """The nodes of a scope: a nested function or class is yielded, not entered (its own scope)."""
    yield node
    if not isinstance(node, _NESTED):
        for child in ast.iter_child_nodes(node):
            yield from _walk_scope(child)


def _bindings(node: ast.AST):
    """(target, value) pairs a node binds: assignments, walrus, for loops and comprehensions
    (the target iterates over the value), with-as."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            yield target, node.value
    elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
        yield node.target, node.value
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        yield node.target, node.iter
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        for item in node.items:
            if item.optional_vars is not None:
                yield item.optional_vars, item.context_expr


def _scopes(body: list[ast.AST], inherited: frozenset[str] = frozenset()):
    """(body, _Scope) of the module's top level and of every function and lambda in it."""
    scope = _Scope(body, inherited)
    yield body, scope
    for node in (n for statement in body for n in _walk_scope(statement)):
        if isinstance(node, _NESTED):
            yield from _scopes(node.body if isinstance(node.body, list) else [node.body], frozenset(scope.tainted))


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {what}")

    # the first scan, by name: a blade's edit called on something that names a blade
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            target = ast.unparse(node.func.value)
            # the blades are reached through a StateManager (`.mirror`, `.cache`, `.state`) or a
            # cache/mirror object; plain containers (sets, dicts, rich tables) are not blades
            if any(word in target for word in ("mirror", "cache", "ledger", "live", ".state", "sm")):
                report(node, f"{ast.unparse(node.func)}(…)")
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE and ast.unparse(node.value) != "self":
            report(node, f"reaches for {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and ast.unparse(node.func) in ("object.__getattribute__", "object.__setattr__", "object.__delattr__"):
            report(node, f"goes round a view with {ast.unparse(node.func)}")
    # the second, by where a value came from: aliases, loop variables, attribute and item writes
    for body, scope in _scopes(tree.body):
        for node in (n for statement in body for n in _walk_scope(statement)):
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and scope.reached(func.value) \
                        and (func.attr in MUTATORS or _in_place(func.attr)):
                    report(node, f"edits a blade: {ast.unparse(func)}(…)")
                elif isinstance(func, ast.Attribute) and _in_place(func.attr) and node.args and scope.reached(node.args[0]):
                    report(node, f"edits a blade in place: {ast.unparse(func)}({ast.unparse(node.args[0])}, …)")
                elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args \
                        and scope.reached(node.args[0]):
                    report(node, f"{func.id} on a blade: {ast.unparse(node)}")
                if any(k.arg == "out" and scope.reached(k.value) for k in node.keywords):
                    report(node, f"writes a blade's tensor as out=: {ast.unparse(func)}(…)")
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if isinstance(node, ast.AugAssign) and scope.reached(node.target):
                report(node, f"edits a blade in place: {ast.unparse(node)}")
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, (ast.Attribute, ast.Subscript)) and scope.reached(part.value):
                        report(node, f"writes into a blade: {ast.unparse(part)}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and scope.reached(node.value) and node.attr not in PRIVATE:
                report(node, f"reaches for a private part of a blade: {ast.unparse(node)}")
    by_line = {}  # one offence per line: the first scan's word for it if both scans found it
    for line in found:
        by_line.setdefault(int(line.split(":")[1]), line)
    return [by_line[number] for number in sorted(by_line)]


def python_files():
    for source in SOURCES:
        path = ROOT / source
        # hidden folders are not the project's (a local bench/.kvpress-venv)
        yield from ([path] if path.is_file() else sorted(p for p in path.rglob("*.py")
                                                        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)))


def test_nothing_outside_state_manager_edits_the_cache_or_the_mirror():
    bad = [line for path in python_files() if not str(path.relative_to(ROOT)).startswith(OWNERS)
           for line in offences(path)]
    assert not bad, "edits outside StateManager:\n" + "\n".join(bad)


def test_the_check_finds_an_edit_outside_state_manager(tmp_path):
    """The scan above must be able to fail: a module that sets brightness behind
    StateManager's back, or reaches for its private mirror, is caught."""
    sneaky = ROOT / "positronic" / "_sneaky_probe.py"
    sneaky.write_text("def f(brain):\n    brain.state.mirror.set_brightness([])\n    return brain.state._mirror\n")
    try:
        found = offences(sneaky)
    finally:
        sneaky.unlink()
    assert len(found) == 2 and "set_brightness" in found[0] and "_mirror" in found[1]


# --- the four writes the name scan missed, planted ------------------------------------------

PLANTED = textwrap.dedent('''\
    def aliased_set_brightness(state):
        m = state.mirror
        m.set_brightness([0.0] * len(m))


    def attribute_write(state):
        state.mirror.live = None


    def layer_splice(state):
        layer = state.cache.layers[0]
        layer.splice([(0, 0, 5)], 5)


    def key_buffer_zero(state):
        key_buffer = state.cache.layers[0].key_buffer
        key_buffer.zero_()
''')
WRITES = {"aliased_set_brightness": "set_brightness", "attribute_write": "live", "layer_splice": "splice",
          "key_buffer_zero": None}  # what each one's ReadOnlyError names (the zero_ goes to a clone)


@pytest.fixture
def planted(tmp_path):
    path = tmp_path / "scratch_writer.py"
    path.write_text(PLANTED)
    spec = importlib.util.spec_from_file_location("scratch_writer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_the_scan_finds_each_planted_write(planted):
    path, _ = planted
    found = offences(path)
    lines = PLANTED.splitlines()
    flagged = {lines[int(line.split(":")[1]) - 1].strip() for line in found}
    assert flagged == {"m.set_brightness([0.0] * len(m))", "state.mirror.live = None",
                       "layer.splice([(0, 0, 5)], 5)", "key_buffer.zero_()"}, found


@pytest.mark.parametrize("route", [
    "setattr(state.cache, 'length', 0)", "torch.zero_(state.cache.layers[0].keys)",
    "torch.add(x, y, out=state.cache.layers[0].value_buffer)", "state.mirror._target.set_brightness([])",
    "object.__getattribute__(state.mirror, 'ledger')", "[layer.reset() for layer in state.cache.layers]",
    "entry = state.mirror.ledger[0]; entry.brightness = 0.0", "state.mirror.live.ledger_ids[0] = 7",
    "ids = state.mirror.live.ledger_ids; del ids[0]", "kb = getattr(state, 'cache').layers[1].key_buffer; kb += 1",
])
def test_the_scan_finds_other_routes(tmp_path, route):
    path = tmp_path / "scratch_route.py"
    path.write_text(f"def f(state, x, y):\n    {route}\n")
    assert offences(path), route


def test_the_scan_lets_copies_and_reads_be(tmp_path):
    """Fresh values read out of a state may be changed: they are the reader's."""
    path = tmp_path / "scratch_reader.py"
    path.write_text(textwrap.dedent('''\
        def f(state, brain):
            ids = list(state.mirror.live.ledger_ids)
            ids.append(3)
            still = set(brain.state.mirror.live.ledger_ids)
            still.add(4)
            keys, values = state.layer_kv(0)
            keys.zero_()
            rows = state.cache.slot_index(5)
            report = brain.state.apply([])
            return len(state.cache.layers[0].keys), state.mirror.brightness()
    '''))
    assert offences(path) == []


def _fingerprint(state: StateManager):
    """Everything a planted write could change: the mirror file, every layer's buffers (whole:
    rows never written may hold NaN, which `escapes` counts as equal to itself)."""
    buffers = [torch.cat([layer.key_buffer.flatten(), layer.value_buffer.flatten()]).clone()
               for layer in state._cache.layers]
    return mirror_pkg.to_bytes(state._mirror), buffers, state._cache.length


def escapes(lm, module) -> dict[str, str]:
    """Each planted write run against a fresh state: what happened, for the ones that got
    through (changed the state, or ran without a ReadOnlyError naming the attribute)."""
    through = {}
    for name, attribute in WRITES.items():
        state = StateManager.from_tokens(lm, list(range(3, 23)))
        before = _fingerprint(state)
        try:
            getattr(module, name)(state)
            raised = None
        except ReadOnlyError as exc:
            raised = str(exc)
        try:
            mirror_bytes, buffers, length = _fingerprint(state)
            changed = mirror_bytes != before[0] or length != before[2] or \
                any(not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(buffers, before[1]))
        except Exception:  # the write broke the state so far that it cannot even be read
            changed = True
        if changed:
            through[name] = "changed the state"
        elif attribute is not None and (raised is None or f"`{attribute}`" not in raised):
            through[name] = f"no ReadOnlyError naming `{attribute}` ({raised})"
    return through


def test_the_views_stop_each_planted_write(tiny, planted):
    assert escapes(tiny, planted[1]) == {}


def test_without_the_views_each_planted_write_gets_through(tiny, planted, monkeypatch):
    """The run-time check can fail: hand out the mutable objects again (the guard removed)
    and every planted write changes the state."""
    monkeypatch.setattr(StateManager, "mirror", property(lambda self: self._mirror))
    monkeypatch.setattr(StateManager, "cache", property(lambda self: self._cache))
    assert escapes(tiny, planted[1]) == {name: "changed the state" for name in WRITES}


# --- what the views give ---------------------------------------------------------------------


def test_the_views_read_what_the_blades_hold(tiny):
    sm = StateManager.from_tokens(tiny, list(range(3, 43)))
    sm.apply([{"action": "delete", "position": 7}, {"action": "add", "token_id": 5}], tick=1)
    view, real = sm.mirror, sm._mirror
    assert isinstance(view, MirrorView) and mirror_pkg.to_bytes(view) == mirror_pkg.to_bytes(real) \
        == view.to_bytes()
    assert view.columns() == mirror_pkg.storage.to_columns(real)
    assert view.live.ledger_ids == real.live.ledger_ids and list(view.live.positions) == real.live.positions
    assert [e.text for e in view.ledger.entries] == view.ledger.column("text") == [e.text for e in real.ledger.entries]
    assert view.ledger[7] == real.ledger[7] and view.ledger[7].state == "culled" and len(view.ledger) == 41
    assert view.brightness() == real.brightness() and view.ring is None and view.layers is None
    copied = view.copy()
    copied.set_brightness([1.0] * len(copied))  # a copy is one's own
    assert mirror_pkg.to_bytes(view) == mirror_pkg.to_bytes(real) != mirror_pkg.to_bytes(copied)
    cache = sm.cache
    assert isinstance(cache, CacheView) and cache.length == len(sm) and cache.memory_bytes() == sm.memory_bytes()
    assert torch.equal(cache.layers[1].keys, sm.layer_kv(1)[0]) and len(cache.layers) == tiny.num_layers
    keys = cache.layers[1].keys
    keys.zero_()  # a clone: the cache keeps its rows
    assert not torch.equal(keys, sm.layer_kv(1)[0])
    sm.check(deep=True)


@pytest.mark.parametrize("write, attribute", [
    (lambda sm: sm.mirror.ledger.entries[0].__setattr__("brightness", 1.0), "brightness"),
    (lambda sm: sm.mirror.live.ledger_ids.append(3), "append"),
    (lambda sm: sm.mirror.ledger.add(1, "x", "user", 0, 1.0), "add"),
    (lambda sm: sm.mirror.live.positions.__setitem__(0, 9), "__setitem__"),
    (lambda sm: sm.cache.layers[0].rotate_keys(0, None, None), "rotate_keys"),
    (lambda sm: sm.cache.layers[0]._write_rows, "_write_rows"),
    (lambda sm: sm.cache.update, "update"),
    (lambda sm: setattr(sm.cache, "kv_format", "int4"), "kv_format"),
])
def test_a_write_through_a_view_raises_naming_the_attribute(tiny, write, attribute):
    sm = StateManager.from_tokens(tiny, list(range(3, 23)))
    with pytest.raises(ReadOnlyError, match=f"`{attribute}`"):
        write(sm)


def test_the_tick_reads_no_cache_through_the_view(tiny, monkeypatch):
    """The forwards use the real cache inside the state: a tick copies no tensor out of it."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)), BrainConfig(budget=40, window=8, seed=1))
    made = []
    monkeypatch.setattr(readonly.CacheView, "__init__", lambda self, target: made.append(target))
    records = [brain.step() for _ in range(16)]
    assert not any(r.rebuilt for r in records) and brain.counts["culls"] > 0, "ticks that edit the cache"
    assert made == []

"""One writer: only StateManager changes the KV cache or the mirror.

Python cannot make an object read-only, so this holds the code to it: outside
positronic/state/manager.py (and the mirror and cache packages themselves), no module calls a
method that edits either blade or reaches for StateManager's private handles.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTATORS = {
    # SpliceCache / SpliceLayer
    "splice", "fill", "rotate_keys", "reserve", "crop", "update", "reset", "index_copy_", "set_positions",
    "write_encoded",
    # Mirror / Ledger / LiveMap
    "set_brightness", "set_pinned", "retire", "resurrect", "truncate", "link_replacement", "add",
}
PRIVATE = {"_mirror", "_cache", "_predicted", "_write_rows"}
OWNERS = {"positronic/state/manager.py", "positronic/kv/cache.py"}
SOURCES = ["positronic", "steps", "bench", "run.py"]


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            target = ast.unparse(node.func.value)
            # the blades are reached through a StateManager (`.mirror`, `.cache`, `.state`) or a
            # cache/mirror object; plain containers (sets, dicts, rich tables) are not blades
            if any(word in target for word in ("mirror", "cache", "ledger", "live", ".state", "sm")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}(…)")
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE and ast.unparse(node.value) != "self":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: reaches for {ast.unparse(node)}")
    return found


def python_files():
    for source in SOURCES:
        path = ROOT / source
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def test_nothing_outside_state_manager_edits_the_cache_or_the_mirror():
    bad = [line for path in python_files() if str(path.relative_to(ROOT)) not in OWNERS for line in offences(path)]
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

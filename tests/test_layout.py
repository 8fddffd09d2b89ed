"""Every source module has tests: a test module of its own name, or a row in
docs/development.md's "Modules tested under another name" naming the test modules that cover
it; and every test module such a row names exists. Pure file walking (ast, no imports of the
project), so it runs in a fraction of a second."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("positronic", "mirror", "steps")
GUIDE = ROOT / "docs" / "development.md"
HEADING = "### Modules tested under another name"
NO_BEHAVIOUR = "no behaviour of its own"


def holds_behaviour(path: Path) -> bool:
    """False for a file that only imports, re-exports (`__all__`) and documents."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
        return True
    return False


def source_modules() -> list[str]:
    """Every .py under the source folders, as a path from the root; an `__init__.py` or
    `__main__.py` only where it holds behaviour."""
    modules = []
    for base in SOURCES:
        for path in sorted((ROOT / base).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name in ("__init__.py", "__main__.py") and not holds_behaviour(path):
                continue
            modules.append(path.relative_to(ROOT).as_posix())
    return modules


def own_test(module: str) -> Path | None:
    """The test module named for `module`, or None where the rule gives none (`__main__.py`)."""
    path = Path(module)
    if path.name == "__main__.py":
        return None
    name = path.parent.name if path.name == "__init__.py" else path.stem
    if path.parts[0] == "steps":
        return ROOT / "tests" / "steps" / f"test_step_{name}.py"
    return ROOT / "tests" / path.parent / f"test_{name}.py"


def guide_rows() -> dict[str, str]:
    """The table under HEADING: module path -> its "tested by" cell."""
    lines = GUIDE.read_text(encoding="utf-8").splitlines()
    assert HEADING in lines, f"{GUIDE.name} has no section {HEADING!r}"
    rows = {}
    for line in lines[lines.index(HEADING) + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] == "module" or set(cells[0]) <= set("-: "):
            continue
        module = cells[0].strip("`")
        assert module not in rows, f"{module} has two rows in {GUIDE.name}"
        rows[module] = "|".join(cells[1:])
    return rows


def test_the_rule_finds_modules_and_their_tests():
    modules = source_modules()
    assert "positronic/models/loading.py" in modules and "mirror/storage.py" in modules
    assert "positronic/cli/__init__.py" in modules and "positronic/kv/__init__.py" not in modules
    assert own_test("positronic/models/loading.py") == ROOT / "tests/positronic/models/test_loading.py"
    assert own_test("steps/sample.py") == ROOT / "tests/steps/test_step_sample.py"
    assert own_test("positronic/cli/__init__.py") == ROOT / "tests/positronic/cli/test_cli.py"


def test_every_module_has_tests_of_its_name_or_a_row_in_the_guide():
    rows = guide_rows()
    untested = [m for m in source_modules()
                if m not in rows and not (own_test(m) is not None and own_test(m).is_file())]
    assert not untested, (f"no tests/…/test_<name>.py and no row in {GUIDE.name}'s {HEADING!r} "
                          f"for: {', '.join(untested)}")


def test_every_row_names_a_module_and_test_modules_that_exist():
    modules = set(source_modules())
    for module, tested_by in guide_rows().items():
        assert module in modules, f"{GUIDE.name}: a row for {module}, which is not a source module with behaviour"
        named = re.findall(r"`(tests/[^`]+\.py)`", tested_by)
        assert named or NO_BEHAVIOUR in tested_by, f"{GUIDE.name}: the row for {module} names no test module"
        missing = [test for test in named if not (ROOT / test).is_file()]
        assert not missing, f"{GUIDE.name}: the row for {module} names missing {', '.join(missing)}"

"""The code stays readable the way a researcher reads it: flat modules without import cycles, each a size one can
read, every function and the loop on one screen, and low modules (storage, checkpoints, logs) that do not load the
DICOM reader."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in REPO.glob("*.py")}
TESTS = {p.stem: p for p in (REPO / "tests").glob("*.py")}
SCREEN = 80  # lines
MODULE_LINES = 800  # a module one reads in a sitting; over it, split along a seam (dicom.py / volumes.py)
OVER_MODULE_LINES = {"probe.py"}  # allowed for now: probe.py is split after the probes being added to it land
CHECKLISTS = {"config.py:validate"}  # flat lists of independent rules or cases
READER = {"dicom", "volumes", "index", "data"}  # volumes.py imports dicom.py, index.py both, data.py all three


def names_imported(node: ast.AST) -> set:
    """The top-level package names an import statement imports (none for any other node)."""
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module.split(".")[0]}
    return set()


def all_imports(path: Path) -> set:
    """The top-level names of every package or module a file imports, anywhere in it (function-level imports
    included)."""
    return set().union(*(names_imported(node) for node in ast.walk(ast.parse(path.read_text()))))


def imported_modules(path: Path) -> set:
    """The project modules a file imports, anywhere in it."""
    return (all_imports(path) & set(MODULES)) - {path.stem}


def loaded_with(name: str) -> set:
    """The project modules that importing `name` loads, itself included (imports of imports)."""
    loaded, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module not in loaded:
            loaded.add(module)
            todo += imported_modules(MODULES[module])
    return loaded


def functions(path: Path):
    """(name, first line, length in lines) of every function and method in a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_module_imports_one_that_imports_it_back():
    edges = {name: imported_modules(path) for name, path in MODULES.items()}
    cycles = []
    for start in edges:
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for nxt in edges[module]:
                if nxt == start:
                    cycles.append(" -> ".join(path + [start]))
                elif nxt not in path:
                    stack.append((nxt, path + [nxt]))
    assert not cycles, cycles


def test_writing_a_checkpoint_or_a_log_line_does_not_load_the_dicom_reader():
    for name in ("runtime", "checkpoint", "runlog"):
        assert not loaded_with(name) & READER, (name, sorted(loaded_with(name)))


def test_loading_an_exported_encoder_loads_neither_the_training_loop_nor_the_reader():
    assert not loaded_with("model") & (READER | {"train", "runtime", "probe"}), sorted(loaded_with("model"))


def test_storage_is_low_it_loads_neither_torch_nor_the_reader():
    loaded = loaded_with("storage")
    third_party = set().union(*(all_imports(MODULES[m]) for m in loaded))
    assert not loaded & READER and not third_party & {"torch", "pydicom"}, (sorted(loaded), sorted(third_party))


def test_every_module_is_a_size_one_can_read():
    long = {p.name: n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert set(long) <= OVER_MODULE_LINES, long


def test_every_function_outside_the_flat_checklists_fits_on_one_screen():
    long = [f"{path.name}:{name} (line {line}, {length} lines)" for path in MODULES.values()
            for name, line, length in functions(path)
            if length > SCREEN and f"{path.name}:{name}" not in CHECKLISTS]
    assert not long, long


def test_the_training_loop_reads_in_one_file_of_a_few_hundred_lines():
    train = MODULES["train"].read_text()
    assert len(train.splitlines()) < 650
    (loop,) = [n for n in ast.walk(ast.parse(train)) if isinstance(n, ast.While)]  # train(): one update per iteration
    assert loop.end_lineno - loop.lineno < 100


def test_tests_share_code_through_helpers_not_through_each_other_or_private_names():
    """tests/helpers.py (and tests/corpora.py) hold what tests share; a test module imports no other test module
    and no private (_name) function of the project."""
    found = []
    for path in TESTS.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module = node.module.split(".")[0]
                if module.startswith("test_") or module == "conftest":
                    found.append(f"{path.name}:{node.lineno} imports {module}")
                if module in MODULES or module in TESTS:
                    found += [f"{path.name}:{node.lineno} imports {module}.{a.name}" for a in node.names
                              if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("test_") or a.name == "conftest"]
    assert not found, found


def test_torch_xla_is_imported_in_one_place():
    """runtime.xla_modules loads torch_xla for every function that needs it (a machine without it imports all)."""
    places = [f"{path.name}:{node.name}" for path in MODULES.values() for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.FunctionDef) and any("torch_xla" in names_imported(n) for n in ast.walk(node))]
    top_level = [path.name for path in MODULES.values() if "torch_xla" in
                 {name for n in ast.parse(path.read_text()).body for name in names_imported(n)}]
    assert places == ["runtime.py:xla_modules"] and not top_level, (places, top_level)

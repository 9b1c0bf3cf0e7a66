"""The commands of the README and the manual run as written. Every `python SCRIPT.py ...` line of their bash blocks
(after `&&`, environment prefixes and `torchrun` options) is taken as a reader would type it: train.py's are
dry-run (`--dry_run`) on a small local phantom set standing in for `gs://my-bucket/oct` and with the run's folders in
a temporary one; every other script's options must be ones its own `--help` lists (or config fields); the
experiments' table scripts run for real on the committed reports."""
import ast
import contextlib
import io
import importlib
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from config import FIELD_NAMES

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/data.md", "docs/outputs.md", "docs/tpu.md", "docs/sharding.md", "docs/performance.md",
         "docs/encoder.md", "docs/privacy.md", "experiments/README.md"]
TABLES = ("experiments/table.py", "experiments/finetune_table.py")  # cheap: they read the committed reports


def commands(page: str) -> list:
    """The `python SCRIPT.py ARGS` commands of a page's bash blocks and inline code spans: [SCRIPT.py, ARGS...]."""
    text = (REPO / page).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`((?:python|torchrun) [^`]+)`", text.replace("\n", " "))
    found = []
    for line in lines:
        tokens = shlex.split(line.replace("<", "").replace(">", ""), comments=True)  # runs/<run>: runs/run
        parts = [[]]
        for token in tokens:
            parts[-1:] = [parts[-1], []] if token == "&&" else [parts[-1] + [token]]
        for words in parts:
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # PJRT_DEVICE=TPU ...
                words.pop(0)
            if words[:1] == ["torchrun"]:
                words = ["python"] + words[next(i for i, w in enumerate(words) if w.endswith(".py")):]
            words = [w for word in words for w in braces(word)]
            if len(words) > 1 and words[0] == "python" and words[1].endswith(".py") and "..." not in words:
                found.append(words[1:])
    return found


def braces(word: str) -> list:
    """The shell's brace expansion of one word: learn-s{0,1,2}.json -> learn-s0.json, learn-s1.json, learn-s2.json."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [w for part in match.group(1).split(",") for w in braces(word[:match.start()] + part + word[match.end():])]


def all_commands() -> list:
    """(page, command) of every page, each command once."""
    found = {}
    for page in PAGES:
        for command in commands(page):
            found.setdefault(tuple(command), page)
    return [(page, list(command)) for command, page in found.items()]


def has_placeholder(argv: list) -> bool:
    """A command with words the reader fills in (NAME, S, CKPT, ARM_A, a glob): runnable only once filled in."""
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*(:\w+)?", w) or re.search(r"[A-Z]{2,}|[*|]", w) for w in argv)


def flag_value(argv: list, flag: str):
    return argv[argv.index(flag) + 1] if flag in argv else None


def dry_run_argv(argv: list, phantoms: str, tmp: Path) -> list:
    """train.py's arguments, dry-run on local data: gs:// and data folders replaced, run folders in tmp."""
    local = {"--data_root": phantoms, "--index_path": str(tmp / "index.jsonl"), "--cache_dir": str(tmp / "cache"),
             "--ckpt_dir": str(tmp / "ckpts"), "--out_dir": str(tmp / "runs"), "--manifest_path": None}
    out, words = [], iter(argv)
    for word in words:
        if word in local:
            next(words)
        elif word == "--device" and flag_value(argv, "--device") == "xla":  # torch_xla: tests/test_xla.py
            next(words)
        elif word != "--dry_run":
            out.append(word)
    return out + [w for flag, value in local.items() if value for w in (flag, value)] + ["--dry_run", "--workers", "0"]


def test_the_pages_name_commands_this_test_can_check():
    scripts = {c[0] for _, c in all_commands()}
    assert {"train.py", "data.py", "sanity.py", "probe.py", "encoder.py", "finetune.py", "bench.py"} <= scripts, scripts
    assert len([c for _, c in all_commands() if c[0] == "train.py"]) >= 5


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> str:
    """40 small phantom volumes: more training volumes than the production configs' global batch of 32."""
    from phantom import write_phantom_set
    return write_phantom_set(str(tmp_path_factory.mktemp("source") / "oct"), 40, shape=(8, 32, 32))


@pytest.mark.slow
def test_every_train_command_of_the_pages_passes_its_dry_run(small_source, tmp_path, capsys):
    import train
    runs = {}
    for page, argv in all_commands():
        if argv[0] == "train.py" and not has_placeholder(argv):
            runs.setdefault(tuple(dry_run_argv(argv[1:], small_source, tmp_path)), (page, argv))
    assert len(runs) >= 4, runs
    for dry_argv, where in runs.items():
        assert train.main(list(dry_argv)) == 0, where
    assert "dry run: nothing trained" in capsys.readouterr().out


def script_help(script: str, argv: list) -> str:
    """The --help text of a script (of its sub-command when argv starts with one)."""
    module = importlib.import_module(script.removesuffix(".py"))
    sub = argv[:1] if argv and not argv[0].startswith("-") and argv[0] in ("scan", "prepare", "export", "embed",
                                                                             "show", "train", "data", "all") else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        module.main(sub + ["--help"])
    assert stop.value.code == 0, (script, sub)
    return out.getvalue()


@pytest.mark.slow
def test_every_option_of_the_commands_is_one_the_script_has():
    unknown = []
    for page, argv in all_commands():
        script = argv[0]
        if script.startswith("experiments/"):
            continue
        text = script_help(script, argv[1:]) if script != "train.py" else ""  # train.py: config flags only
        options = [word.split("=")[0] for word in argv[1:] if word.startswith("--")]
        unknown += [(page, script, option) for option in options
                    if option[2:] not in FIELD_NAMES + ["config"] and not re.search(rf"{option}\b", text)]
    assert not unknown, unknown


def test_the_experiment_table_commands_print_their_tables(capsys, monkeypatch):
    ran = 0
    for page, argv in all_commands():
        if argv[0] in TABLES and not has_placeholder(argv):
            monkeypatch.setattr(sys, "argv", argv)
            monkeypatch.chdir(REPO)
            runpy.run_path(str(REPO / argv[0]), run_name="__main__")
            assert capsys.readouterr().out.count("|") > 10, (page, argv)
            ran += 1
    assert ran >= 3


def heading_anchors(page: Path) -> set:
    """GitHub's anchors of a markdown page's headings: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_of_the_pages_reaches_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES + ["docs/config.md", "docs/incidents.md"]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", (REPO / page).read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (REPO / page).parent / target if target else REPO / page
            if not path.exists():
                broken.append(f"{page}: {target}")
            elif anchor and path.suffix == ".md" and anchor[1:] not in heading_anchors(path):
                broken.append(f"{page}: {target}{anchor}")
    assert not broken, broken


def defined_names(path: Path) -> set:
    """Module-level functions, classes and assignments of a file, and Class.method for the methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
    return names


def test_every_place_the_readme_says_to_change_exists_where_it_says():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Where to change what"):readme.index("## Files")]
    places = re.findall(r"\[`(\w+\.py):([\w.]+)`\]\((\w+\.py)\)", table)
    assert len(places) >= 30, places
    missing = [f"{file}:{name}" for file, name, link in places
               if link != file or name not in defined_names(REPO / file)]
    assert not missing, missing

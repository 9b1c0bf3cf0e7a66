"""The commands of the README and the manual run as written. Every `python SCRIPT.py ...` line of
their bash blocks (after `&&`, environment prefixes and `torchrun` options) is taken as a reader
would type it: train.py's are dry-run (`--dry_run`) on a small local phantom set standing in for
`gs://my-bucket/oct` and with the run's folders in a temporary one; every other script's options
must be ones its own `--help` lists (or config fields); the experiments' table scripts run for real
on the committed reports."""

import ast
import contextlib
import io
import importlib
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from config import FIELD_NAMES

REPO = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "docs/data.md",
    "docs/outputs.md",
    "docs/tpu.md",
    "docs/sharding.md",
    "docs/performance.md",
    "docs/encoder.md",
    "docs/privacy.md",
    "experiments/README.md",
]
# cheap: they read the committed reports
TABLES = ("experiments/table.py", "experiments/finetune_table.py")


def commands(page: str) -> list:
    """The `python SCRIPT.py ARGS` commands of a page's bash blocks and inline code spans:
    [SCRIPT.py, ARGS...]."""
    text = (REPO / page).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`((?:python|torchrun) [^`]+)`", text.replace("\n", " "))
    found = []
    for line in lines:
        # runs/<run>: runs/run
        tokens = shlex.split(line.replace("<", "").replace(">", ""), comments=True)
        parts = [[]]
        for token in tokens:
            parts[-1:] = [parts[-1], []] if token == "&&" else [parts[-1] + [token]]
        for words in parts:
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # PJRT_DEVICE=TPU ...
                words.pop(0)
            if words[:1] == ["torchrun"]:
                words = ["python"] + words[
                    next(i for i, w in enumerate(words) if w.endswith(".py")) :
                ]
            words = [w for word in words for w in braces(word)]
            if (
                len(words) > 1
                and words[0] == "python"
                and words[1].endswith(".py")
                and "..." not in words
            ):
                found.append(words[1:])
    return found


def braces(word: str) -> list:
    """The shell's brace expansion of one word: learn-s{0,1,2}.json -> learn-s0.json, learn-s1.json,
    learn-s2.json."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [
        w
        for part in match.group(1).split(",")
        for w in braces(word[: match.start()] + part + word[match.end() :])
    ]


def all_commands() -> list:
    """(page, command) of every page, each command once."""
    found = {}
    for page in PAGES:
        for command in commands(page):
            found.setdefault(tuple(command), page)
    return [(page, list(command)) for command, page in found.items()]


def has_placeholder(argv: list) -> bool:
    """A command with words the reader fills in (NAME, S, CKPT, ARM_A, a glob): runnable only once
    filled in."""
    return any(
        re.fullmatch(r"[A-Z][A-Z0-9_]*(:\w+)?", w) or re.search(r"[A-Z]{2,}|[*|]", w) for w in argv
    )


def flag_value(argv: list, flag: str):
    return argv[argv.index(flag) + 1] if flag in argv else None


def dry_run_argv(argv: list, phantoms: str, tmp: Path) -> list:
    """train.py's arguments, dry-run on local data: gs:// and data folders replaced, run folders in
    tmp."""
    local = {
        "--data_root": phantoms,
        "--index_path": str(tmp / "index.jsonl"),
        "--cache_dir": str(tmp / "cache"),
        "--ckpt_dir": str(tmp / "ckpts"),
        "--out_dir": str(tmp / "runs"),
        "--manifest_path": None,
    }
    out, words = [], iter(argv)
    for word in words:
        if word in local:
            next(words)
        # torch_xla: tests/test_xla.py
        elif word == "--device" and flag_value(argv, "--device") == "xla":
            next(words)
        elif word != "--dry_run":
            out.append(word)
    return (
        out
        + [w for flag, value in local.items() if value for w in (flag, value)]
        + ["--dry_run", "--workers", "0"]
    )


def test_the_pages_name_commands_this_test_can_check():
    scripts = {c[0] for _, c in all_commands()}
    assert {
        "train.py",
        "data.py",
        "sanity.py",
        "probe.py",
        "encoder.py",
        "finetune.py",
        "bench.py",
    } <= scripts, scripts
    assert len([c for _, c in all_commands() if c[0] == "train.py"]) >= 5


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> str:
    """40 small phantom volumes: more training volumes than the production configs' global batch of
    32."""
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
    sub = (
        argv[:1]
        if argv
        and not argv[0].startswith("-")
        and argv[0] in ("scan", "prepare", "export", "embed", "show", "train", "data", "all")
        else []
    )
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
        # train.py: config flags only
        text = script_help(script, argv[1:]) if script != "train.py" else ""
        options = [word.split("=")[0] for word in argv[1:] if word.startswith("--")]
        unknown += [
            (page, script, option)
            for option in options
            if option[2:] not in FIELD_NAMES + ["config"] and not re.search(rf"{option}\b", text)
        ]
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
    """GitHub's anchors of a markdown page's headings: lower case, punctuation dropped, spaces as
    dashes."""
    headings = re.findall(
        r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M
    )
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_of_the_pages_reaches_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES + ["docs/config.md", "docs/incidents.md", "experiments/NOTES.md"]:
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
    """Module-level functions, classes and assignments of a file, and Class.method for the
    methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {
                t.id
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            }
    return names


def test_every_place_the_readme_says_to_change_exists_where_it_says():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Where to change what") : readme.index("## Files")]
    places = re.findall(r"\[`(\w+\.py):([\w.]+)`\]\((\w+\.py)\)", table)
    assert len(places) >= 30, places
    missing = [
        f"{file}:{name}"
        for file, name, link in places
        if link != file or name not in defined_names(REPO / file)
    ]
    assert not missing, missing


# Pointers stay honest: what a page loads is made by a command it shows first, every path it names
# exists, every pointer to a section of a page names one that is there, and "Does it learn?" stays
# one table of today's results.


def code_in_order(text: str) -> list:
    """The code of a page in reading order: each line of its fenced blocks, and each inline code
    span elsewhere."""
    found = []
    for block, inline in re.findall(r"```\w*\n(.*?)```|`([^`\n]+)`", text, re.S):
        found += block.replace("\\\n", " ").splitlines() if block else [inline]
    return found


def run_folder(args: list):
    """The run folder a real `python train.py ARGS` writes (out_dir/run_name), or None: a dry run,
    or a timestamped name. The flags win over the --config file, which wins over the Config
    defaults; no flags at all is the demo."""
    from config import DEMO_FLAGS, Config, load_yaml, parse_flags

    flags = parse_flags(args or DEMO_FLAGS)
    if "dry_run" in flags:
        return None
    values = {f.name: f.default for f in Config.__dataclass_fields__.values()}
    values.update(load_yaml(str(REPO / flags["config"])) if "config" in flags else {}, **flags)
    return f"{values['out_dir']}/{values['run_name']}" if values["run_name"] else None


OUTPUT_FLAGS = ("--out", "--json", "--plot")
# docs/outputs.md, "The run folder"
RUN_FILES = ("config.yaml", "metrics.jsonl", "events.jsonl", "training.png")


def made_and_read(line: str) -> tuple:
    """(the runs/ paths a line of code writes, the runs/ paths it reads). What a command writes is
    the value of an output flag, with all under it, or a training run's folder: its files and
    checkpoints/ (an export or a fine-tuning inside that folder is made by another command). A
    placeholder (runs/<run>) is neither."""
    made, read = [], []
    for part in re.split(r"&&|;", re.sub(r"\s#.*", "", line)):
        words = re.findall(r"[^\s\"'(),=]+", part)
        train = re.search(r"\b(?:python3?|torchrun)\s(?:.*\s)?train\.py\b(.*)", part)
        folder = run_folder(train.group(1).split()) if train else None
        if folder:
            files = "|".join(map(re.escape, RUN_FILES))
            made.append(re.compile(rf"{re.escape(folder)}(/checkpoints(/.*)?|/({files}))?"))
        for i, word in enumerate(words):
            if word.startswith("runs/") and "<" not in word and "..." not in word:
                if i and words[i - 1] in OUTPUT_FLAGS:
                    made.append(re.compile(re.escape(word.rstrip("/")) + "(/.*)?"))
                else:
                    read.append(word.rstrip("/.:"))
    return made, read


def test_every_run_folder_the_readme_reads_is_made_by_a_command_it_shows_before():
    """`load_encoder("runs/learn/encoder")` needs an `encoder.py export ... --out
    runs/learn/encoder` shown above it, not only the run `runs/learn`: a reader follows the page top
    to bottom."""
    made, read, unmade = [], [], []
    for line in code_in_order((REPO / "README.md").read_text()):
        writes, reads = made_and_read(line)
        unmade += [path for path in reads if not any(m.fullmatch(path) for m in made)]
        made, read = made + writes, read + reads
    assert not unmade, f"read before any command shown writes them: {unmade}"
    assert len(made) >= 5 and len(read) >= 10, (made, read)  # the page's commands were found


def named_paths(text: str) -> list:
    """The repository paths a page names, in prose, code or links: experiments/..., docs/...,
    configs/...; braces expanded, placeholders (NAME, ARM_sS, *) and the uncommitted
    experiments/runs/ left out."""
    found = []
    for word in re.findall(r"(?<![\w/.-])((?:experiments|docs|configs)/[\w./{},-]*[\w}/])", text):
        found += [
            w
            for w in braces(word)
            if not re.search(r"[A-Z]{2,}|_s[A-Z]\b|_s[A-Z]\.|\*", w)
            and not w.startswith("experiments/runs/")
        ]
    return found


def test_every_path_the_readmes_name_exists():
    missing = [
        f"{page}: {path}"
        for page in ("README.md", "experiments/README.md")
        for path in named_paths((REPO / page).read_text())
        if not (REPO / path).exists()
    ]
    assert not missing, missing


def section(page: Path, heading: str) -> str:
    """The text under the first heading of a page that starts with `heading`, up to the next heading
    of its level."""
    text = page.read_text()
    match = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.M)
    assert match, f"{page.name} has no heading {heading!r}"
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", text[match.end() :], re.M)
    return text[match.end() : match.end() + end.start() if end else len(text)]


POINTER = re.compile(
    r"(?<![\w/])((?:[\w-]+/)*(?:[\w-]+\.md|README|NOTES))(?:'s)?[,:]?\s*\(?\"([A-Za-z][^\"]{0,80})\""
    r"(\s+numbers)?"
)


def pointer_target(name: str) -> Path:
    """README and NOTES name the top-level README.md and experiments/NOTES.md; other names are
    repository paths."""
    return REPO / {
        "README": "README.md",
        "NOTES": "experiments/NOTES.md",
        "NOTES.md": "experiments/NOTES.md",
    }.get(name, name)


def test_every_pointer_to_a_section_names_one_that_is_there():
    """In every file of the repository: a page followed by words in quotes (configs/learn.yaml's
    pointers to experiments/README.md) finds those words on that page, and where `numbers` follows
    them (a claim that the section so named holds figures), figures in that section; NOTES.md's
    `section N` finds its heading `## N.`."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    notes = (REPO / "experiments" / "NOTES.md").read_text()
    broken = []
    for name in files:
        if (
            not name.endswith((".md", ".py", ".yaml", ".sh", ".diff", ".log"))
            or not (REPO / name).exists()
        ):
            continue
        text = (REPO / name).read_text(errors="replace")
        for page, words, numbers in POINTER.findall(text):
            target, words = pointer_target(page), " ".join(words.split())
            if not target.exists() or words not in " ".join(target.read_text().split()):
                broken.append(f"{name}: {page}, {words!r}")
            elif numbers and not re.search(r"\d\.\d{3}", section(target, words.rstrip("?"))):
                broken.append(f"{name}: {page}, {words!r} has no numbers")
        for first, last in re.findall(r"NOTES(?:\.md)?,? sections? (\d+)(?:-(\d+))?", text):
            broken += [
                f"{name}: NOTES section {n}"
                for n in {first, last or first}
                if not re.search(rf"^## {n}\. ", notes, re.M)
            ]
    assert not broken, broken


def suite_validity() -> dict:
    """task: "valid" or "not valid", as experiments/README.md's table of the suite says (its last
    column)."""
    rows = re.findall(
        r"^\| `(\w+)`[^\n]*\| (?:\*\*)?(not valid|valid)",
        section(REPO / "experiments/README.md", "The learning suite"),
        re.M,
    )
    return dict(rows)


def test_does_it_learn_is_one_short_table_of_todays_results_each_with_its_command():
    """The README states today's result, not its history (that is experiments/): at most 30 lines,
    one table, no dated rows, each row with the command that produces it, and a task that is not
    valid says so in its row."""
    text = section(REPO / "README.md", "Does it learn?")
    assert len(text.strip("\n").splitlines()) <= 30, len(text.strip("\n").splitlines())
    dated = re.search(r"\b20\d\d-\d\d-\d\d\b|until that|that evening", text)
    assert not dated, f"a dated row ({dated.group(0)}): history goes to experiments/"
    tables = re.findall(r"(?:^\|.*\n)+", text, re.M)
    assert len(tables) == 1, f"{len(tables)} tables"
    rows = tables[0].splitlines()[2:]
    assert len(rows) >= 4, rows
    validity = suite_validity()
    assert "valid" in validity.values(), validity  # the suite's table says which tasks count
    invalid = {task for task, verdict in validity.items() if verdict == "not valid"}
    for row in rows:
        assert re.search(r"`python [\w/]+\.py[^`]*`", row), f"a row without its command: {row}"
        named = set(re.findall(r"`(\w+)`", row)) & invalid
        assert not named or "not valid" in row, (
            f"{named} is not a valid task; its row must say so: {row}"
        )

"""Every command that octjepa's messages, warnings and usage lines suggest (`python SCRIPT.py ...`)
runs as written: the script exists, so does its sub-command, and it accepts every flag, value and
argument the command gives it."""

import ast
import contextlib
import dataclasses
import glob
import importlib
import io
import os
import re
import shlex
import shutil
import typing

import pytest

import config
import data
import encoder
import finetune
import probe
from index import read_index, scan_command
from runlog import next_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"python ([A-Za-z_]\w*)\.py\b")
UPPER_WORD = re.compile(r"(?<![A-Za-z])[A-Z][A-Z0-9_]*(?![a-z])")
# [--opt X], --opt X, x
USAGE_PART = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]|--\S+(?: (?!-)[^\s\[]+)?|\S+")
# stands for arguments left to the reader: `...`, `[config flags]`, an f-string's {flags}
ANYTHING = "..."


def literal_text(node: ast.AST) -> str:
    """A string literal's text; an f-string's {expression} stays {expression}, without spaces (one
    word)."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(
        (
            v.value
            if isinstance(v, ast.Constant)
            else "{" + ast.unparse(v.value).replace(" ", "") + "}"
        )
        for v in node.values
    )


def command_at(text: str, start: int) -> str:
    """The command that begins at text[start] ('python ...'): up to its closing backtick (across a
    line break) or parenthesis when it opens after one, else to the end of the line; without a `#
    comment` or a shell redirection."""
    closing = {"`": "`", "(": ")"}.get(text[start - 1 : start], "\n")
    ends = (
        (text.find(closing, start), len(text))
        if closing == "`"
        else (text.find(closing, start), text.find("\n", start), len(text))
    )
    return " ".join(re.split(r"\s#|\s>", text[start : min(i for i in ends if i >= 0)])[0].split())


def suggested_commands():
    """(where, command) for each `python SCRIPT.py ...` in the string literals of the product
    modules."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        parts = {
            id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.JoinedStr)
                or isinstance(node, ast.Constant)
                and isinstance(node.value, str)
            ) and id(node) not in parts:
                text = literal_text(node)
                found += [
                    (f"{os.path.basename(path)}:{node.lineno}", command_at(text, m.start()))
                    for m in COMMAND.finditer(text)
                ]
    return found


def is_placeholder(word: str) -> bool:
    """A value the reader fills in: DIR, RUN/config.yaml, <folder>, an f-string's {value}, ...."""
    return word == ANYTHING or word[:1] in "<{" or bool(UPPER_WORD.search(word))


@dataclasses.dataclass
class Usage:
    """What a script (or one of its sub-commands) accepts, as its --help usage line says."""

    # name -> (required, its value: "flag" (none), "optional", "any" or a tuple of choices)
    options: dict
    # (name, required, choices or None); a sub-command's choices come with sub_commands=True
    positionals: list
    sub_commands: bool
    config_fields: tuple  # the Config fields it takes as flags


def help_text(script: str, argv: list) -> str:
    """What `python SCRIPT argv --help` prints."""
    module = importlib.import_module(script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(argv + ["--help"])
    return out.getvalue()


def config_fields_taken(script: str, sub: str, command: list) -> tuple:
    """The Config fields a script takes as --flags: an export or a checkpoint brings its own model
    and preprocessing."""
    if script == "encoder":
        return encoder.CLI_FIELDS.get(sub, ())
    if script == "finetune":
        return finetune.CLI_FIELDS
    if script == "probe" and "random" not in command:
        return probe.CKPT_FIELDS
    if script == "phantom":
        return ()
    return tuple(config.FIELD_NAMES) + ("config",)


def usage(script: str, sub: list, command: list) -> Usage:
    """The options and positional arguments of `python SCRIPT.py [SUB]`, read from its usage
    line."""
    text = help_text(script, sub).split("\n\n")[0].split(None, 2 + len(sub))[-1]
    options, positionals, sub_commands = {}, [], False
    for part in USAGE_PART.findall(text):
        required = not part.startswith("[")
        inner = part[1:-1] if not required else part
        if inner == "-h":
            continue
        if inner == ANYTHING:
            sub_commands = True
        elif inner.startswith("--"):
            name, _, value = inner[2:].partition(" ")
            options[name] = (
                required,
                (
                    "flag"
                    if not value
                    else (
                        "optional"
                        if value.startswith("[")
                        else tuple(value[1:-1].split(","))
                        if value.startswith("{")
                        else "any"
                    )
                ),
            )
        else:
            positionals.append(
                (inner, required, tuple(inner[1:-1].split(",")) if inner.startswith("{") else None)
            )
    return Usage(
        options,
        positionals,
        sub_commands,
        config_fields_taken(script, sub[0] if sub else "", command),
    )


def problems(command: str) -> list:
    """What stops `command` (python SCRIPT.py ...) from running as written, in words; [] when
    nothing does."""
    script = COMMAND.match(command).group(1)
    if not os.path.exists(os.path.join(ROOT, f"{script}.py")):
        return [f"there is no {script}.py"]
    # [config flags], [DIR]: an optional part in words; [--json OUT]: an optional flag, checked like
    # any other.
    words = shlex.split(
        re.sub(r"\[[^\[\]-]*\]", f" {ANYTHING} ", command[COMMAND.match(command).end() :])
        .replace("[", " ")
        .replace("]", " ")
    )
    if not hasattr(importlib.import_module(script), "main"):
        return [f"{script}.py takes no arguments, got {' '.join(words)}"] if words else []
    sub = []
    top = usage(script, [], words)
    if top.sub_commands:
        names = top.positionals[0][2]
        if not words or words[0] not in names:
            return [
                f"{script}.py needs one of the sub-commands {', '.join(names)}, got {words[:1]}"
            ]
        sub = words[:1]
    spec = usage(script, sub, words) if sub else top
    named = " ".join([f"{script}.py", *sub])
    found, given, positionals, i = [], set(), list(spec.positionals), len(sub)
    # `python data.py scan` in prose names the command, it suggests no arguments
    mention = len(words) == len(sub)
    while i < len(words):
        word, i = words[i], i + 1
        if not word.startswith("--"):
            if word == ANYTHING or word.startswith("{"):
                given.add(ANYTHING)
            elif not positionals:
                found.append(f"{word!r} is not an argument that {named} takes")
            else:
                name, _, choices = positionals.pop(0)
                given.add(name)
                if choices and not is_placeholder(word) and word not in choices:
                    found.append(f"{name}: {word!r} is not one of {', '.join(choices)}")
            continue
        name, eq, value = word[2:].partition("=")
        if name not in spec.options:
            name = name.replace("-", "_")  # config.parse_flags reads --base-lr as --base_lr
        has_next = i < len(words) and not words[i].startswith("--")
        if name in spec.options:
            kind = spec.options[name][1]
        elif name in spec.config_fields:
            is_bool = name != "config" and bool in (
                config.FIELD_TYPES[name],
                *typing.get_args(config.FIELD_TYPES[name]),
            )
            kind = "optional" if is_bool else "any"
        elif name == "help":
            continue
        else:
            found.append(f"--{name} is not a flag of {named}")
            i += not eq and has_next  # its value
            continue
        given.add(name)
        if kind == "flag":
            if eq:
                found.append(f"--{name} takes no value, got {value!r}")
            continue
        if not eq and (has_next or kind != "optional"):
            if not has_next:
                found.append(f"--{name} needs a value")
                continue
            value, i = words[i], i + 1
        if not value or is_placeholder(value):
            continue
        if isinstance(kind, tuple) and value not in kind:
            found.append(f"--{name} {value}: not one of {', '.join(kind)}")
        elif name == "config" and not os.path.isfile(os.path.join(ROOT, value)):
            found.append(f"--config {value}: no such file")
        elif name in config.FIELD_TYPES:
            try:
                converted = config.convert_value(name, value, True)
                if converted not in config.CHOICES.get(name, (converted,)):
                    found.append(f"--{name} {value}: not one of {', '.join(config.CHOICES[name])}")
            except config.ConfigError as e:
                found.append(f"--{name} {value}: {e}")
    if not mention and ANYTHING not in given:
        missing = [
            f"--{n}" for n, (required, _) in spec.options.items() if required and n not in given
        ]
        missing += [n for n, required, _ in positionals if required]
        found += [f"{named} needs {m}" for m in missing]
    return found


def test_every_command_an_error_suggests_runs_as_written():
    commands = suggested_commands()
    # the walk finds the usage lines, the errors' advice and the warnings'
    assert len(commands) > 40, commands
    broken = [
        f"{where}: {command}\n    {'; '.join(found)}"
        for where, command in commands
        for found in [problems(command)]
        if found
    ]
    assert not broken, "\n".join(broken)


def test_the_commands_after_a_run_take_its_real_paths_and_labels(tmp_path):
    for cfg in (
        config.load_config([]),
        config.load_config(["--data_root", str(tmp_path / "my oct")]),
        config.load_config(
            ["--manifest_path", str(tmp_path / "m.csv"), "--probe_labels", "labels.csv"]
        ),
    ):
        commands = next_commands(cfg, str(tmp_path / "runs" / "demo"))
        assert {c: problems(c) for c in commands} == {c: [] for c in commands}


def test_the_scan_advised_for_a_manifest_lists_the_files_of_the_manifest(phantom_dir, tmp_path):
    names = ["0000_heidelberg.dcm", "0001_topcon_triton.dcm"]
    # the third is in the folder, not in the manifest
    for name in names + ["0002_zeiss_cirrus.dcm"]:
        shutil.copy(os.path.join(phantom_dir, name), tmp_path / name)
    (tmp_path / "manifest.csv").write_text("filepath\n" + "".join(f"{n}\n" for n in names))
    command = scan_command(None, str(tmp_path / "manifest.csv"))
    assert problems(command) == []
    assert data.main(shlex.split(command)[2:] + ["--out", str(tmp_path / "index.jsonl")]) == 0
    assert (
        sorted(os.path.basename(r["paths"][0]) for r in read_index(str(tmp_path / "index.jsonl")))
        == names
    )
    assert scan_command("/data/my oct") == "python data.py scan '/data/my oct'"
    assert (
        scan_command("/data", "lists/m.tsv")
        == "python data.py scan /data --manifest_path lists/m.tsv"
    )


def test_a_misspelt_flag_or_sub_command_in_advice_is_caught():
    assert problems("python encoder.py export --ckpt CKPT --out DIR") == []
    assert problems("python encoder.py export --ckpt CKPT --output DIR") == [
        "--output is not a flag of encoder.py export",
        "encoder.py export needs --out",
    ]
    assert problems("python encoder.py exprot --ckpt CKPT") == [
        "encoder.py needs one of the sub-commands export, embed, show, got ['exprot']"
    ]
    assert problems("python train.py --config RUN/config.yaml --resume auto --base-lr 1e-4") == []
    assert problems("python train.py --config RUN/config.yaml --resume auto --base_rl 1e-4") == [
        "--base_rl is not a flag of train.py"
    ]
    assert problems("python finetune.py --encoder DIR --labels labels.csv --base_lr 1e-4") == [
        "--base_lr is not a flag of finetune.py"
    ]  # the export brings its own model and preprocessing
    assert problems("python sanity.py --lr_sweep measures a good one") == [
        "'a' is not an argument that sanity.py takes",
        "'good' is not an argument that sanity.py takes",
        "'one' is not an argument that sanity.py takes",
    ]
    assert problems("python train.py --schedule cosnie") == [
        "--schedule cosnie: not one of cosine, constant"
    ]
    assert problems("python trian.py") == ["there is no trian.py"]

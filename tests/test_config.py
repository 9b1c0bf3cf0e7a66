"""Config: YAML + flags, typed values, and one clear error per problem (incidents 3, 4, 8)."""

import dataclasses
import json
import subprocess
import sys
import textwrap
import warnings

import pytest

from checkpoint import changed_settings
from config import (
    REMOVED_FIELDS,
    Config,
    ConfigError,
    ScriptParser,
    load_config,
    plan_run,
    save_config,
    script_main,
)

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def write_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        base_lr: 3.0e-4
        min_lr: 1e-6
        epochs: 7
        image_size: [32, 64, 64]
    """,
    )
    cfg = load_config(["--config", path, "--base_lr", "1e-4", "--epochs=9"])
    assert cfg.base_lr == 1e-4 and cfg.epochs == 9
    assert cfg.min_lr == 1e-6  # YAML's 1e-6 (read by YAML as a string) is a float
    assert cfg.image_size == [32, 64, 64]
    assert cfg.weight_decay == Config().weight_decay


def test_every_field_type_parses_from_the_command_line():
    cfg = load_config(
        [
            "--image_size",
            "32,128,128",
            "--target_spacing=0.2,0.02,0.02",
            "--use_bf16",
            "--dry_run",
            "false",
            "--grad_clip",
            "none",
            "--max_steps",
            "1e3",
            "--run_name",
            "x",
        ]
    )
    assert cfg.image_size == [32, 128, 128]
    assert cfg.target_spacing == [0.2, 0.02, 0.02]
    assert cfg.use_bf16 is True and cfg.dry_run is False
    assert cfg.grad_clip is None
    assert cfg.max_steps == 1000 and isinstance(cfg.max_steps, int)


@pytest.mark.parametrize("field", ["compile", "grad_checkpointing"])
def test_the_auto_fields_take_true_false_and_auto_from_flags_and_yaml_and_nothing_else(
    tmp_path, field
):
    assert getattr(Config(), field) == "auto"
    for argv, expected in (
        ([f"--{field}"], True),
        ([f"--{field}", "false"], False),
        ([f"--{field}=Auto"], "auto"),
        ([f"--{field}", "yes"], True),
    ):
        assert getattr(load_config(argv), field) == expected, argv
    for text, expected in (("true", True), ("false", False), ("auto", "auto")):
        assert (
            getattr(load_config(["--config", write_yaml(tmp_path, f"{field}: {text}")]), field)
            == expected
        )
    for bad in (
        ["--config", write_yaml(tmp_path, f"{field}: null")],
        [f"--{field}", "sometimes"],
        ["--config", write_yaml(tmp_path, f"{field}: 2")],
    ):
        with pytest.raises(ConfigError, match=f"{field}: expected true, false or auto"):
            load_config(bad)
    with pytest.raises(ConfigError, match=f"{field}: expected true, false or auto"):
        load_config([], **{field: "maybe"})
    assert (
        getattr(
            load_config(["--config", write_yaml(tmp_path, f"{field}: auto")], **{field: True}),
            field,
        )
        is True
    )


@pytest.mark.parametrize(
    "argv", [["--ckpt_dir", "None"], ["--ckpt_dir", "null"], ["--ckpt_dir=NONE"]]
)
def test_ckpt_dir_none_on_the_command_line_disables_checkpoints(argv):
    assert load_config(argv).ckpt_dir is None


def test_ckpt_dir_null_in_yaml_disables_checkpoints(tmp_path):
    assert load_config(["--config", write_yaml(tmp_path, "ckpt_dir: null\n")]).ckpt_dir is None


@pytest.mark.parametrize("value", ['"None"', "'null'", "None"])
def test_ckpt_dir_string_none_in_yaml_is_an_error(tmp_path, value):
    with pytest.raises(ConfigError, match="ckpt_dir.*not a path"):
        load_config(["--config", write_yaml(tmp_path, f"ckpt_dir: {value}\n")])


def test_a_scripts_own_defaults_yield_to_yaml_and_flags(tmp_path):
    ours = {"image_size": [16, 64, 64], "patch_size": [4, 8, 8], "epochs": 3}
    path = write_yaml(tmp_path, "image_size: [32, 64, 64]\n")
    cfg = load_config(["--config", path, "--epochs", "5"], defaults=ours)
    assert cfg.image_size == [32, 64, 64] and cfg.epochs == 5 and cfg.patch_size == [4, 8, 8]
    assert load_config([], defaults=ours, epochs=7).epochs == 7


def test_unknown_flag_suggests_the_closest_name():
    with pytest.raises(ConfigError, match="Did you mean 'base_lr'"):
        load_config(["--base_lrr", "1e-4"])


def test_unknown_yaml_key_suggests_the_closest_name(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'warmup_steps'"):
        load_config(["--config", write_yaml(tmp_path, "warmup_step: 10\n")])


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b"base_lr: 1e-4\nimage_size:\n\t- 8\n",
            "line 3: found character '\\t' that cannot start any token; indent with spaces",
        ),
        (
            b"base_lr: 1e-4\nrun_name: !!python/object/apply:os.system [touch HACKED]\n",
            (
                "line 2: could not determine a constructor for the tag"
                " 'tag:yaml.org,2002:python/object/apply:os.system'; write plain values"
            ),
        ),
        (
            b"base_lr: 1e-4\nrun_name: \xe9tude\n",
            (
                "line 2: byte 0xe9 is not UTF-8 text (Latin-1?); save the file as UTF-8, "
                "e.g. `iconv -f latin1 -t utf-8"
            ),
        ),
        (
            b"base_lr: 1e-4\nmax_steps: 5\nbase_lr: 3e-4\n",
            (
                "line 3: the key 'base_lr' is given twice, on lines 1 and 3; "
                "delete the line you do not mean"
            ),
        ),
    ],
    ids=["tab", "python_tag", "latin1", "key_twice"],
)
def test_a_yaml_config_that_cannot_be_read_as_written_is_refused_with_its_line_and_the_fix(
    tmp_path, content, message
):
    """A config that PyYAML refuses (a tab, a Python tag, Latin-1 text) once ended in a traceback,
    and one that gives a key twice silently trained with the later value."""
    config = tmp_path / "job.yaml"
    config.write_bytes(content)
    refused = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", str(config), "--dry_run", "true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert f"config: {config}, {message}" in refused.stderr
    # nothing ran, nothing was changed
    assert not (tmp_path / "HACKED").exists() and config.read_bytes() == content


@script_main
def seeds_script(argv):
    """A script with its own --seeds option next to the config flags, as probe.py has."""
    parser = ScriptParser("Probes over seeds.")
    parser.add_argument("--seeds", type=int, default=5)
    args, rest = parser.parse(argv)
    print(args.seeds, load_config(rest).seed)
    return 0


def test_a_scripts_bad_option_exits_2_like_a_bad_config_flag_naming_the_closest_option(capsys):
    # --seed is the config field, not short for --seeds
    assert seeds_script(["--seeds", "3", "--seed", "7"]) == 0
    assert capsys.readouterr().out == "3 7\n"
    assert seeds_script(["--seeds", "many"]) == 2
    assert capsys.readouterr().err.startswith(
        "config error: argument --seeds: invalid int value: 'many'"
    )
    assert (
        seeds_script(["--seedss", "3"]) == 2 and "Did you mean 'seeds'?" in capsys.readouterr().err
    )
    assert (
        seeds_script(["--base_lr", "0"]) == 2
        and "config error: base_lr: 0.0 would not train" in capsys.readouterr().err
    )


def test_every_exit_status_of_every_script_is_in_the_one_table_in_config():
    import ast
    from config import EXIT_CODES, ExitError

    # every script's errors (train, data, probe, model come along)
    import encoder  # noqa: F401
    import finetune  # noqa: F401
    import sanity  # noqa: F401

    errors, todo = [], [ExitError]
    while todo:
        errors.append(todo.pop())
        todo += errors[-1].__subclasses__()
    assert {e.exit_code for e in errors} <= set(EXIT_CODES), {
        e.__name__: e.exit_code for e in errors
    }
    elsewhere = [
        f"{path.name}:{node.lineno}"
        for path in REPO.glob("*.py")
        if path.name != "config.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "exit_code" for t in node.targets)
    ]
    assert not elsewhere, f"exit codes set outside config.py: {elsewhere}"


SCRIPTS = [
    "train.py",
    "data.py",
    "phantom.py",
    "probe.py",
    "sanity.py",
    "bench.py",
    "encoder.py",
    "finetune.py",
]
RUN_AS_PROGRAMS = """
import contextlib, io, json, runpy, sys
helps = {}
for argv in json.loads(sys.argv[1]):
    sys.argv, out, code = argv, io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code
    helps[" ".join(argv)] = [code, out.getvalue()]
print(json.dumps(helps))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    """{command: [exit code, stdout]} of `python SCRIPT --help` for each script (and `encoder.py
    embed --help`), each run as a program (its __main__), one after the other in one interpreter:
    the imports they share, once."""
    commands = [[script, "--help"] for script in SCRIPTS] + [["encoder.py", "embed", "--help"]]
    result = subprocess.run(
        [sys.executable, "-c", RUN_AS_PROGRAMS, json.dumps(commands)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.xdist_group("helps")  # one worker runs the scripts once
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_explains_itself_and_the_config_flags_with_help(script, helps):
    code, text = helps[f"{script} --help"]
    assert code == 0 and text.startswith("usage: ")
    assert ("Every Config field is also a flag" in text) == (
        script not in ("phantom.py", "encoder.py")
    )


@pytest.mark.slow
@pytest.mark.xdist_group("helps")
def test_each_encoder_command_lists_the_config_flags_it_takes_not_every_field(helps):
    code, text = helps["encoder.py embed --help"]
    assert code == 0 and "Every Config field" not in text
    assert "The config flags it takes: --device, --cache_dir, --workers, --data_root" in text


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--epochs", "ten"], "epochs"),
        (["--base_lr", "fast"], "base_lr"),
        (["--use_bf16", "maybe"], "use_bf16"),
        (["--image_size", "64,64"], "image_size"),
        (["--epochs", "none"], "epochs"),
    ],
)
def test_wrong_type_names_the_field(argv, field):
    with pytest.raises(ConfigError, match=field):
        load_config(argv)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(image_size=[16, 60, 64]), "image_size"),
        (dict(mask_ratio=0.0), "mask_ratio"),
        (dict(mask_ratio=1.0), "mask_ratio"),
        (dict(min_lr=1e-3, base_lr=1e-4), "min_lr"),
        (dict(base_lr=0.0), "base_lr"),
        (dict(min_lr=0.0), "min_lr"),
        (dict(max_steps=100, warmup_steps=100), "warmup_steps"),
        (dict(epochs=2, warmup_epochs=5), "warmup_epochs"),
        (dict(schedule="constant", warmup_steps=10), "warmup_steps"),
        (dict(schedule="cosin"), "schedule"),
        (dict(grad_clip=0.0), "grad_clip"),
        (dict(shard="zero3"), "shard"),
        (dict(fsdp_size=4), "fsdp_size"),  # without shard fsdp
        (dict(shard="fsdp", fsdp_size=0), "fsdp_size"),
        (dict(patch_stem="conv"), "patch_stem"),
        (
            dict(patch_stem="hmlp", image_size=[16, 64, 60], patch_size=[4, 8, 6]),
            "patch_stem: hmlp cuts each tubelet",
        ),
        (
            dict(patch_stem="hmlp", image_size=[15, 64, 64], patch_size=[3, 8, 8]),
            "patch_stem: hmlp cuts each tubelet",
        ),
    ],
)
def test_invalid_values_are_rejected_with_the_field_named(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config([], **overrides)


def test_tiny_grad_clip_warns_about_sign_sgd():
    with pytest.warns(UserWarning, match="sign-like"):
        load_config(["--grad_clip", "0.01"])


def test_default_grad_clip_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config([])


def test_batch_sizes_derive_accumulation_from_world_size():
    cfg = load_config(["--global_batch_size", "32", "--per_core_batch_size", "2"])
    plan = plan_run(cfg, world_size=4, train_volumes=1000)
    assert plan.grad_accum_steps == 4 and plan.global_batch_size == 32
    assert plan.steps_per_epoch == 1000 // 32 and plan.total_steps == 31 * cfg.epochs


def test_inconsistent_batch_sizes_are_an_error():
    cfg = load_config(
        ["--global_batch_size", "32", "--per_core_batch_size", "2", "--grad_accum_steps", "2"]
    )
    with pytest.raises(ConfigError, match="global_batch_size"):
        plan_run(cfg, world_size=4, train_volumes=1000)


def test_global_batch_is_derived_when_null():
    cfg = load_config(
        ["--global_batch_size", "none", "--per_core_batch_size", "2", "--grad_accum_steps", "3"]
    )
    assert plan_run(cfg, world_size=2, train_volumes=100).global_batch_size == 12


def test_warmup_epochs_become_steps_and_max_steps_wins_over_epochs():
    cfg = load_config(["--max_steps", "50", "--warmup_epochs", "1"])
    plan = plan_run(cfg, world_size=1, train_volumes=80)
    assert plan.total_steps == 50 and plan.warmup_steps == 10


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(
        ["--ckpt_dir", "none", "--image_size", "32,64,64", "--target_spacing", "0.1,0.02,0.02"]
    )
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(["--config", str(tmp_path / "config.yaml")]) == cfg


def active_value(default):
    """A value of a removed field other than its old default: what a run that used the option
    saved."""
    return True if isinstance(default, bool) else 0 if default is None else default + 1


@pytest.mark.parametrize("name", REMOVED_FIELDS)
def test_a_config_saved_by_an_older_octjepa_reads_as_before_unless_it_used_a_field_that_moved_to_a_patch(
    tmp_path, name
):
    """Checkpoints, a run's config.yaml and exports' training configs of the old main hold the
    fields that moved to experiments/patches/ at their old default: they read as before. A run that
    used one is refused naming the patch, as is the field given as a flag."""
    default, patch = REMOVED_FIELDS[name]
    old = {**dataclasses.asdict(Config()), name: default}  # what the old main saved
    # a checkpoint (probe, export, random init of an export)
    assert load_config([], **old) == Config()
    path = write_yaml(
        tmp_path,
        "\n".join(
            f"{k}: {v if v is not None else 'null'}" for k, v in [("epochs", 7), (name, default)]
        ),
    )
    assert load_config(["--config", path]) == load_config([], epochs=7)  # a run's config.yaml
    assert changed_settings(old, Config()) == []  # resume
    moved = f"experiments/patches/{patch}"
    for use in (
        lambda: load_config([], **{**old, name: active_value(default)}),
        lambda: load_config(
            ["--config", write_yaml(tmp_path, f"{name}: {active_value(default)}\n")]
        ),
        lambda: changed_settings({**old, name: active_value(default)}, Config()),
        lambda: load_config([f"--{name}", str(default)]),
    ):
        with pytest.raises(ConfigError, match=f"{name}.*{moved}"):
            use()


@pytest.mark.parametrize(
    "name",
    [
        "demo",
        "smoke",
        "pretrain_single_domain",
        "pretrain_multi_domain",
        "pretrain_vitl",
        "pretrain_vitg",
    ],
)
def test_shipped_configs_are_valid(name):
    load_config(["--config", str(REPO / "configs" / f"{name}.yaml")])


def test_production_config_has_the_documented_settings():
    cfg = load_config(["--config", str(REPO / "configs" / "pretrain_single_domain.yaml")])
    assert (
        cfg.image_size == [64, 384, 384] and cfg.patch_size == [4, 16, 16] and cfg.mask_ratio == 0.6
    )
    assert cfg.global_batch_size == 32 and cfg.base_lr == 1e-4 and cfg.weight_decay == 0.05
    assert cfg.ema_base == 0.996 and cfg.epochs == 150 and cfg.use_bf16
    for name in (
        "pretrain_single_domain",
        "pretrain_multi_domain",
        "pretrain_vitl",
        "pretrain_vitg",
    ):
        cfg = load_config(["--config", str(REPO / "configs" / f"{name}.yaml")])
        # decided on the device they run on
        assert cfg.grad_checkpointing == "auto" and cfg.compile == "auto", name


def test_fsdp_size_must_divide_the_devices_of_the_run_except_in_a_dry_run_planning_for_more():
    from runtime import sharding_size

    assert sharding_size(load_config(["--shard", "fsdp"]), 8) == 8  # all devices
    # a 2 x 4 data x fsdp mesh
    assert sharding_size(load_config(["--shard", "fsdp", "--fsdp_size", "4"]), 8) == 4
    assert sharding_size(load_config(["--shard", "none"]), 8) == 1
    with pytest.raises(ConfigError, match="fsdp_size: 3 does not divide the 8 devices"):
        sharding_size(load_config(["--shard", "fsdp", "--fsdp_size", "3"]), 8)
    assert sharding_size(load_config(["--shard", "fsdp", "--fsdp_size", "16", "--dry_run"]), 1) == 1


def test_the_config_reference_page_is_every_field_as_config_py_defines_it():
    """Regenerate with: python config.py > docs/config.md"""
    from config import reference_page, reference_table

    assert (REPO / "docs" / "config.md").read_text() == reference_page()
    assert all(f"| `{f.name}` |" in reference_table() for f in dataclasses.fields(Config))

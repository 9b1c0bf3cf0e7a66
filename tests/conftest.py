"""Shared fixtures: phantom DICOM sets written once per session (per worker process under
pytest.ini's -n), a real training checkpoint and its exported encoder, and a real local GCS
emulator; the order tests start in."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `pytest` run from anywhere imports the repo's flat modules

# The patient-key secret of the tests' "site" (privacy.py), never the user's own
# ~/.config/octjepa/site.key. It is fixed: pretraining's train/val split is drawn from patient keys,
# so a new secret per session would give every session another split, and the demo another encoder
# and verdict.
if "OCTJEPA_PATIENT_KEY_FILE" not in os.environ:
    os.environ["OCTJEPA_PATIENT_KEY_FILE"] = os.path.join(
        tempfile.mkdtemp(prefix="octjepa-tests-"), "site.key"
    )
    Path(os.environ["OCTJEPA_PATIENT_KEY_FILE"]).write_text(
        "octjepa-tests-site-secret-0123456789abcdef\n"
    )
    # a key file others can read is refused (privacy.py)
    os.chmod(os.environ["OCTJEPA_PATIENT_KEY_FILE"], 0o600)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # More workers than cores (pytest.ini's -n): torch's threads in each worker, and in the runs its
    # tests start, would contend for the cores, where torch's spinning threads slow training many
    # times over (measured on two busy cores: test_frozen_target_overfits_one_batch 131 s with two
    # threads, 7 s with one). before torch is imported (by helpers, below): it reads it once
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers import GCSEmulator, phantom_flags  # noqa: E402


def pytest_collection_modifyitems(items):
    """Start the longest tests first: `slowest`, then `slow`, then the rest, each in file order.
    pytest.ini's workers take the next test when they are free, so they finish together instead of
    one running a long test alone."""
    items.sort(
        key=lambda item: (
            0 if item.get_closest_marker("slowest") else 1 if item.get_closest_marker("slow") else 2
        )
    )


@pytest.fixture(scope="session")
def phantom_dir(tmp_path_factory) -> str:
    """Ten phantom volumes, two per maker style (see phantom.STYLES), with labels.csv; written
    once."""
    from phantom import write_phantom_set

    return write_phantom_set(str(tmp_path_factory.mktemp("phantoms") / "set"), n=10)


@pytest.fixture(scope="session")
def smoke_phantoms(tmp_path_factory) -> str:
    """The smoke config's phantom set, written and scanned once for the session: its index beside it
    (helpers.index_beside), which the runs of helpers.phantom_flags reuse."""
    from config import load_config
    from index import index_records
    from phantom import ensure_builtin_phantoms

    phantom_dir = str(tmp_path_factory.mktemp("smoke_phantoms"))
    cfg = load_config(
        ["--config", str(REPO / "configs" / "smoke.yaml"), *phantom_flags(phantom_dir)]
    )
    ensure_builtin_phantoms(cfg)
    index_records(cfg)  # scanned into cfg.index_path
    return phantom_dir


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory, smoke_phantoms) -> str:
    """The last checkpoint of a real 4-update training run of the smoke config."""
    import train

    tmp = tmp_path_factory.mktemp("encoder_run")
    assert (
        train.main(
            [
                "--config",
                str(REPO / "configs" / "smoke.yaml"),
                *phantom_flags(smoke_phantoms),
                "--out_dir",
                str(tmp / "runs"),
                "--run_name",
                "r",
                "--max_steps",
                "4",
                "--ckpt_every_steps",
                "4",
            ]
        )
        == 0
    )
    return str(tmp / "runs" / "r" / "checkpoints" / "step_0000004.pt")


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory, trained_checkpoint) -> str:
    """That run's encoder, exported by `encoder.py export` from its checkpoints folder."""
    import encoder

    out = str(tmp_path_factory.mktemp("export") / "encoder")
    assert (
        encoder.main(["export", "--ckpt", os.path.dirname(trained_checkpoint), "--out", out]) == 0
    )
    return out


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A running emulator for the session, with STORAGE_EMULATOR_HOST set while it runs."""
    emulator = GCSEmulator(tmp_path_factory.mktemp("gcs"))
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
    yield emulator
    emulator.stop()
    if previous is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = previous

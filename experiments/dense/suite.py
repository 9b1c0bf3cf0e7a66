"""The learning suite's labelled varied phantoms as issue 33's scripts read them
(handmade_attentive.py, kept_targets.py, local_fit.py): learn.yaml's config, the volumes, and the
`lesion` task with its targets."""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from config import Config, load_config  # noqa: E402
from labels import load_labelled_volumes, phantom_labels, task_targets  # noqa: E402
from readouts import Task  # noqa: E402


def lesion_suite(max_volumes=None):
    """(cfg, volumes [M,1,D,H,W], task, targets [M]) of the suite's labelled varied phantoms (at
    most max_volumes, as load_labelled_volumes draws them), written on first use, with learn.yaml's
    config and the `lesion` task."""
    cfg: Config = load_config(
        ["--config", "configs/learn.yaml", "--phantom_dir", "data/phantoms256"]
    )
    labels_csv = phantom_labels(cfg, varied=True)
    cfg = dataclasses.replace(cfg, cache_dir=os.path.dirname(labels_csv) + "-cache")
    volumes, values, _ = load_labelled_volumes(
        cfg, labels_csv, max_volumes=max_volumes, columns=["lesion"]
    )
    task = Task("lesion", "lesion")
    return cfg, volumes, task, task_targets(values["lesion"], labels_csv)[0]

"""Sharded training (shard: fsdp) with FSDP2 in real gloo processes under torchrun: the unsharded
run's losses and EMA weights, about 1/N of the weights and AdamW state per process, and checkpoints
that resume unsharded and on another number of processes. (XLA SPMD sharding: tests/test_xla.py; the
dry run's memory report: test_model.py.)"""

import subprocess
import sys

import numpy as np
import pytest

from helpers import (
    REPO,
    SHARD_FLAGS,
    assert_holds_a_share,
    assert_same_state,
    final_checkpoint,
    losses,
    metrics,
    smoke_flags,
    stderr_excerpt,
)
from train import main

# one worker builds `unsharded` once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("shard_unsharded")]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, smoke_phantoms):
    """The reference: one process, nothing sharded. Its run folder."""
    out = tmp_path_factory.mktemp("unsharded")
    assert main(smoke_flags(out, smoke_phantoms, *SHARD_FLAGS, "--per_core_batch_size", "4")) == 0
    return out / "runs" / "r"


def torchrun_train(tmp_path, phantoms, processes: int, *flags):
    """train.py in `processes` gloo processes; returns its run folder."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            str(REPO / "train.py"),
            *smoke_flags(tmp_path, phantoms, *SHARD_FLAGS, *flags),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, stderr_excerpt(result)
    return tmp_path / "runs" / "r"


def test_fsdp_over_2_processes_trains_like_one_process_on_half_the_memory_and_its_checkpoint_resumes_unsharded(
    tmp_path, smoke_phantoms, unsharded
):
    # Two micro-batches per update: gradients accumulate in the shards.
    sharded = torchrun_train(
        tmp_path / "two",
        smoke_phantoms,
        2,
        "--shard",
        "fsdp",
        "--per_core_batch_size",
        "1",
        "--grad_accum_steps",
        "2",
    )
    np.testing.assert_allclose(losses(sharded), losses(unsharded), rtol=1e-5)
    # The validation too: the whole val set, not one rounded down to a multiple of 2 (a process that
    # runs out of val volumes first runs a padding forward that counts for nothing).
    val = [[r["loss"] for r in metrics(run, "val")] for run in (sharded, unsharded)]
    assert len(val[1]) == 1 and np.allclose(*val, rtol=1e-5), val
    assert_same_state(final_checkpoint(sharded), final_checkpoint(unsharded))
    assert_holds_a_share(sharded, unsharded, 1 / 2)

    # The sharded run's checkpoint of update 4, resumed by one unsharded process, continues it
    # exactly.
    assert (
        main(
            smoke_flags(
                tmp_path / "one",
                smoke_phantoms,
                *SHARD_FLAGS,
                "--per_core_batch_size",
                "4",
                "--resume",
                str(sharded / "checkpoints" / "step_0000004.pt"),
            )
        )
        == 0
    )
    np.testing.assert_allclose(
        losses(tmp_path / "one" / "runs" / "r"), losses(unsharded, after=4), rtol=1e-5
    )


def test_fsdp_over_4_processes_resumes_an_unsharded_checkpoint_and_continues_it_exactly(
    tmp_path, smoke_phantoms, unsharded
):
    sharded = torchrun_train(
        tmp_path,
        smoke_phantoms,
        4,
        "--shard",
        "fsdp",
        "--per_core_batch_size",
        "1",
        "--resume",
        str(unsharded / "checkpoints" / "step_0000004.pt"),
    )
    assert len(losses(sharded)) == 10
    np.testing.assert_allclose(losses(sharded), losses(unsharded, after=4), rtol=1e-5)
    assert_same_state(final_checkpoint(sharded), final_checkpoint(unsharded))
    assert_holds_a_share(sharded, unsharded, 1 / 4)

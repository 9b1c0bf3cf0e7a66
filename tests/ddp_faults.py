"""Run train.py's real main() under torchrun with faults injected into some processes (tests/test_resume.py uses
it for the multi-process stories). Faults, comma-separated:

    late_start   process 1 starts 1.5 s after process 0 (their clocks name different seconds)
    nan_5_7      updates 5 to 7 have a non-finite loss in every process (a rollback follows)
    read_once    process 1's first checkpoint read fails (a transient storage error)
    read_always  every checkpoint read of process 1 fails
    bad_files    process 1 cannot read the Heidelberg-style volumes (a quarter of the phantoms)
    no_data      process 1 cannot read any volume
    exit_report  each process prints how many gloo worker threads are left when the interpreter starts its
                 teardown (0 once the process group was left)

usage: torchrun ... tests/ddp_faults.py FAULTS TRAIN_FLAGS...
"""
import atexit
import glob
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import dicom  # noqa: E402
import runtime  # noqa: E402
import train  # noqa: E402

faults = set(sys.argv[1].split(","))
rank = int(os.environ["RANK"])

if "exit_report" in faults:
    def report_gloo_threads():  # registered before train's own exit handlers, so it runs after them
        names = [open(comm).read().strip() for comm in glob.glob("/proc/self/task/*/comm")]
        print(f"process {rank}: gloo worker threads at exit: {sum(n.startswith('pt_gloo') for n in names)}",
              file=sys.stderr, flush=True)

    atexit.register(report_gloo_threads)

if "late_start" in faults and rank == 1:
    time.sleep(1.5)

if "nan_5_7" in faults:
    real_forward_backward, updates = train.forward_backward, []

    def forward_backward(*args, **kwargs):
        loss, target_std = real_forward_backward(*args, **kwargs)
        updates.append(len(updates) + 1)
        return (loss * float("nan") if 5 <= updates[-1] <= 7 else loss), target_std

    train.forward_backward = forward_backward

if rank == 1 and faults & {"read_once", "read_always"}:
    real_read_bytes, reads = runtime.read_bytes, []

    def read_bytes(path):
        reads.append(path)
        if "read_always" in faults or len(reads) == 1:
            raise OSError(f"injected read error for {path}")
        return real_read_bytes(path)

    runtime.read_bytes = read_bytes

if rank == 1 and faults & {"bad_files", "no_data"}:
    real_load = data.load_prepared

    def load_prepared(paths, cfg, sources=None):
        if "no_data" in faults or "heidelberg" in paths[0]:
            raise dicom.UnusableFile("read_error", f"injected read error on process 1 for {paths[0]}")
        return real_load(paths, cfg, sources)

    data.load_prepared = load_prepared

sys.exit(train.main(sys.argv[2:]))

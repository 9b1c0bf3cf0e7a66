"""Run train.py's real main() in one of several processes (DDP ranks under torchrun, or simulated
XLA hosts: RANK names the process) with faults injected into some of them; tests/test_resume.py,
test_preemption.py and test_xla.py use it for the multi-process stories. Faults, comma-separated:

    late_start   process 1 starts 1.5 s after process 0 (their clocks name different seconds)
    nan_5_7      updates 5 to 7 have a non-finite loss in every process (a rollback follows)
    read_once    process 1's first checkpoint read fails (a transient storage error)
    read_twice   process 1's first two checkpoint reads fail (a transient error a single retry does
                 not outlast)
    read_always  every checkpoint read of process 1 fails
    bad_files    process 1 cannot read the Heidelberg-style volumes (a quarter of the phantoms)
    no_data      process 1 cannot read any volume
    exit_report  each process prints how many gloo worker threads are left when the interpreter
                 starts its teardown (0 once the process group was left)
    report       each process prints the update it resumed at and how many checkpoint states it
                 built
    race_lock    the process waits at the run folder's lock until the file $OCTJEPA_TEST_GO exists
                 (after touching $OCTJEPA_TEST_READY.PID), then judges a gone holder slowly (0.5 s):
                 a second process judges meanwhile
    no_flock     flock fails as on a filesystem without file locks (NFS mounted nolock, some FUSE
                 mounts): ENOLCK
    sigkill_at_3 the process is SIGKILLed (the OOM killer) during its third update
    stall_in_save
                 the process stalls in its second checkpoint, after its fencing check and before the
                 write (a suspended job, a VM pause): it touches $OCTJEPA_TEST_READY and waits until
                 $OCTJEPA_TEST_GO exists
    sigterm_in_probe, sigint_in_probe
                 the process sends itself SIGTERM (or SIGINT, Ctrl-C) from inside the DICOM reader,
                 while the end-of-run verdict reads its second labelled volume
    sigterm_in_encoder
                 the process sends itself SIGTERM from inside the JPEG 2000 encoder (a Python
                 logging call that openjpeg's C code makes while it encodes a frame), while the
                 end-of-run verdict writes its labelled phantoms: an outside signal arriving there
                 runs its handler at that very place

usage: torchrun ... tests/faults.py FAULTS TRAIN_FLAGS...   (or one python per simulated XLA host,
RANK=0, 1...)
"""

import atexit
import faulthandler
import glob
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import dicom  # noqa: E402
import checkpoint  # noqa: E402
import train  # noqa: E402

faults = set(sys.argv[1].split(","))
rank = int(os.environ.get("RANK", "0"))
# a test that finds this process hung asks for its stacks
faulthandler.register(signal.SIGUSR1, all_threads=True)

if "exit_report" in faults:

    def report_gloo_threads():  # registered before train's own exit handlers, so it runs after them
        names = [open(comm).read().strip() for comm in glob.glob("/proc/self/task/*/comm")]
        print(
            f"process {rank}: gloo worker threads at exit:"
            f" {sum(n.startswith('pt_gloo') for n in names)}",
            file=sys.stderr,
            flush=True,
        )

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

if rank == 1 and faults & {"read_once", "read_twice", "read_always"}:
    real_load_file, reads = checkpoint.load_file, []

    def load_file(path):
        reads.append(path)
        if "read_always" in faults or len(reads) <= 1 + ("read_twice" in faults):
            raise OSError(f"injected read error for {path}")
        return real_load_file(path)

    checkpoint.load_file = load_file

if rank == 1 and faults & {"bad_files", "no_data"}:
    real_load = data.load_prepared

    def load_prepared(paths, cfg, sources=None):
        if "no_data" in faults or "heidelberg" in paths[0]:
            raise dicom.UnusableFile(
                "read_error", f"injected read error on process 1 for {paths[0]}"
            )
        return real_load(paths, cfg, sources)

    data.load_prepared = load_prepared

if "report" in faults:
    real_resume, real_state, built = train.resume, checkpoint.checkpoint_state, []

    def resume(run):
        out = real_resume(run)
        print(f"process {rank}: resumed at update {run.state.step}", file=sys.stderr, flush=True)
        return out

    def checkpoint_state(*args, **kwargs):
        built.append(1)
        return real_state(*args, **kwargs)

    train.resume, checkpoint.checkpoint_state = resume, checkpoint_state
    atexit.register(
        lambda: print(
            f"process {rank}: checkpoint states built: {len(built)}", file=sys.stderr, flush=True
        )
    )

if "race_lock" in faults:
    import lock  # noqa: E402

    real_take_lock, real_holder_is_gone = lock.take_lock, lock.holder_is_gone

    def take_lock(folder):
        Path(f"{os.environ['OCTJEPA_TEST_READY']}.{os.getpid()}").touch()
        while not os.path.exists(os.environ["OCTJEPA_TEST_GO"]):
            time.sleep(0.01)
        return real_take_lock(folder)

    def holder_is_gone(*args):
        gone = real_holder_is_gone(*args)
        time.sleep(0.5 if gone else 0)
        return gone

    lock.take_lock, lock.holder_is_gone = take_lock, holder_is_gone

if "no_flock" in faults:
    import errno
    import fcntl

    def flock_without_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    fcntl.flock = flock_without_locks

if "sigkill_at_3" in faults:
    import signal

    real_train_update, update_calls = train.train_update, []

    def train_update_then_kill(*args, **kwargs):
        update_calls.append(1)
        if len(update_calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_train_update(*args, **kwargs)

    train.train_update = train_update_then_kill

if "stall_in_save" in faults:
    real_checkpoint_state, states = checkpoint.checkpoint_state, []

    def stalled_checkpoint_state(*args, **kwargs):
        states.append(1)
        if len(states) == 2:
            Path(os.environ["OCTJEPA_TEST_READY"]).touch()
            while not os.path.exists(os.environ["OCTJEPA_TEST_GO"]):
                time.sleep(0.01)
        return real_checkpoint_state(*args, **kwargs)

    checkpoint.checkpoint_state = stalled_checkpoint_state

if faults & {"sigterm_in_probe", "sigint_in_probe"}:
    import signal
    import pydicom
    import runprobe

    stop = signal.SIGTERM if "sigterm_in_probe" in faults else signal.SIGINT
    real_prepare_probe_set, real_dcmread, probe_reads = (
        runprobe.prepare_probe_set,
        pydicom.dcmread,
        [],
    )

    def dcmread(*args, **kwargs):
        probe_reads.append(args)
        if len(probe_reads) == 2:
            os.kill(os.getpid(), stop)  # its handler runs here, inside the reader's `try`
        return real_dcmread(*args, **kwargs)

    def prepare_probe_set(*args, **kwargs):
        pydicom.dcmread = dcmread  # from here on every read is the verdict's
        return real_prepare_probe_set(*args, **kwargs)

    runprobe.prepare_probe_set = prepare_probe_set

if "sigterm_in_encoder" in faults:
    import logging
    import signal
    import runprobe

    real_prepare_probe_set, encoder_log = (
        runprobe.prepare_probe_set,
        logging.getLogger("openjpeg.encode"),
    )

    # called by openjpeg's C encoder (encode_buffer) in the middle of a frame
    def debug(*args, **kwargs):
        del encoder_log.debug  # once
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, inside the encoder

    def prepare_probe_set(*args, **kwargs):
        # from here on every encoded frame is the verdict's labelled phantoms'
        encoder_log.debug = debug
        return real_prepare_probe_set(*args, **kwargs)

    runprobe.prepare_probe_set = prepare_probe_set

# a loader worker imports this file again (as __mp_main__): the faults, not the run
if __name__ == "__main__":
    sys.exit(train.main(sys.argv[2:]))

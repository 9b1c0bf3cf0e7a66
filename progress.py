"""Progress of long work for a person: a tqdm bar on a terminal, plain lines with the time left in a
log file (nohup, SLURM), and the durations they print. Imports nothing of the project, so that any
module can show progress."""

import sys
import time
from typing import Iterator, Optional, Sequence

from tqdm import tqdm


def duration_text(seconds: float) -> str:
    """A duration in words: 45s, 3m20s, 2h05m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLines:
    """Progress for a log file, nohup or SLURM (no terminal): a line on stderr every `every` items
    and at the last, with the items done, the time so far and an estimate of the time left. Used
    like a tqdm bar (update, close, with)."""

    def __init__(
        self, total: int, desc: str, unit: str, initial: int = 0, every: Optional[int] = None
    ):
        self.total, self.desc, self.unit, self.n, self.first = total, desc, unit, initial, initial
        self.every = every or max(1, (total - initial) // 10)
        self.start = time.monotonic()

    def update(self, n: int = 1) -> None:
        """n more items done; a line when a multiple of `every` or the last item is passed."""
        self.n += n
        if (self.n - self.first) // self.every > (
            self.n - n - self.first
        ) // self.every or self.n == self.total:
            elapsed, done = time.monotonic() - self.start, self.n - self.first
            left = (
                f", about {duration_text(elapsed / done * (self.total - self.n))} left"
                if self.n < self.total
                else ""
            )
            print(
                f"{self.desc}: {self.n}/{self.total} {self.unit}s, {duration_text(elapsed)}{left}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Nothing to tidy (the tqdm interface)."""

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str, unit: str, initial: int = 0, every: Optional[int] = None):
    """A tqdm bar on a terminal, ProgressLines (a plain line every `every` items, with the time
    left) otherwise."""
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)
    return ProgressLines(total, desc, unit, initial, every)


def counted(items: Sequence, desc: str, unit: str, every: Optional[int] = None) -> Iterator:
    """Each item in turn, with progress(): an item counts as done when the loop asks for the next
    one."""
    with progress(len(items), desc, unit, every=every) as bar:
        for item in items:
            yield item
            bar.update(1)

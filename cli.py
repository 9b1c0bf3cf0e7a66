"""The command line that every script shares: its parser (ScriptParser: the script's own options,
the Config flags left over for load_config), its main (script_main: an ExitError ends it with its
message and exit code), and a stop signal while it still imports (preempt_at_once_on_stop_signals).
Light on purpose: config and the standard library.
"""

import argparse
import functools
import os
import signal
import sys
from typing import List, Optional, Set, Tuple

from config import ConfigError, ExitError, Preempted, parse_flags


def preempt_at_once_on_stop_signals(script: str) -> None:
    """From now on, until a run installs its own handlers (runtime.StopSignals), SIGTERM and Ctrl-C
    end the process at once with config.Preempted's exit code and a line on stderr saying to run the
    same command again: a stop while a script imports and starts is a preemption, not a kill (exit
    143) nor a traceback."""

    def stopped(signum, frame):
        os.write(
            2,
            f"preempted: {signal.Signals(signum).name} while {script} was starting: run the same"
            " command again\n".encode(),
        )
        # at once: an exception raised inside torch's import could crash it
        os._exit(Preempted.exit_code)

    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, stopped)


CONFIG_FLAGS_HELP = (
    "Every Config field is also a flag: --base_lr 1e-4, --image_size 64,384,384, none for an\n"
    "optional field; --config FILE reads fields from YAML (see docs/config.md)."
)


class ScriptParser(argparse.ArgumentParser):
    """argparse for a script's own options (sub-commands where it has several verbs); parse() leaves
    the `--field value` config flags over for load_config. A bad option raises ConfigError (exit 2),
    not SystemExit."""

    def __init__(self, description: Optional[str] = None, config_flags: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        # --seed is a config flag, not short for a script's --seeds
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("epilog", CONFIG_FLAGS_HELP if config_flags else None)
        super().__init__(description=description, **kwargs)

    def error(self, message: str):
        raise ConfigError(f"{message} (see --help).")

    def option_names(self) -> List[str]:
        """The names of the script's own options, its sub-commands' included."""
        names = []
        for action in self._actions:
            if action.option_strings and action.dest != "help":
                names.append(action.dest)
            if isinstance(action.choices, dict):  # the sub-commands: {name: parser}
                names += [n for sub in action.choices.values() for n in sub.option_names()]
        return names

    def parse(self, argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
        """(the script's options, the config flags left over); ConfigError for an argument that is
        neither, naming the closest config field or script option."""
        args, rest = self.parse_known_args(argv)
        parse_flags(rest, self.option_names())
        return args, rest


def given_flags(argv: List[str]) -> Set[str]:
    """The names of the flags in argv: Config fields, and 'config' for --config FILE."""
    return set(parse_flags(argv))


def script_main(main):
    """Decorate a script's main(argv) -> exit code: argv defaults to sys.argv[1:], and an ExitError
    ends it with its message on stderr and its exit code."""

    @functools.wraps(main)
    def run(argv: Optional[List[str]] = None) -> int:
        try:
            return main(sys.argv[1:] if argv is None else list(argv))
        except ExitError as e:
            print(f"{e.prefix}{e}", file=sys.stderr)
            return e.exit_code

    return run

"""cli.py: one-line errors for every command line (train.py, model.py, data.py, tasks.py, experiments.py, bench.py).

What it is: the project's promise that a bad input ends in one `error: ...` line on stderr (exit 2), never a
traceback. Each entry point parses its flags with ArgumentParser (a mistyped flag is one line too), checks their
values up front with fail(), and runs its work inside one_line_errors(), the one place where what user input
can raise (a missing or unreadable file, bad JSON, text that is not UTF-8, a damaged safetensors file, a foreign
config without a field) becomes that line. Readers that know the file and line raise DataError /
CheckpointError (ValueErrors) with them in the message, so a new reader gets the same treatment without new code.
It imports no project module, so every module can use it.

How to run it: it is not run on its own.
"""
import argparse
import signal
import sys
from contextlib import contextmanager

from safetensors import SafetensorError


def fail(msg, code=2):
    """One clear line, no traceback."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes (unknown flag, a value of the wrong type) are one `error:` line too, exit 2."""

    def error(self, message):
        fail(f"{message} (see {self.prog} --help)")


def user_error_line(e):
    """The one line for an error that user input raises (a bad file, flag or checkpoint): the file, line, flag
    or value at fault comes from the message when the raiser knew it (DataError, CheckpointError do)."""
    if isinstance(e, UnicodeDecodeError):       # a reader that did not name its file (data.read_text does)
        return f"not UTF-8 text: byte {e.object[e.start:e.start + 1].hex()} ({e.reason})"
    if isinstance(e, OSError):                  # disk full, read-only, a folder where a file should be, ...
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
        return f"{where}: {e.strerror or e}" if where else f"{e.strerror or e}"
    if isinstance(e, KeyError):                 # a foreign config / checkpoint without a field we read
        return f"missing field {e.args[0]!r} (a config or checkpoint from elsewhere?)"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# what user input can raise: ValueError covers DataError, CheckpointError, JSON and Unicode errors
USER_ERRORS = (ValueError, OSError, KeyError, SafetensorError)


@contextmanager
def one_line_errors(interrupted="interrupted"):
    """The one place user errors are caught: every entry point's main runs inside it. A user error ends in one
    `error:` line, exit 2; Ctrl-C in one line, exit 130."""
    signal.signal(signal.SIGINT, signal.default_int_handler)    # the scripts exit quietly on Ctrl-C while importing
    try:
        yield
    except KeyboardInterrupt:
        fail(interrupted, code=130)
    except USER_ERRORS as e:
        fail(user_error_line(e))

"""Helpers shared by the tests.

train_args: train.py's arguments exactly as train.py's own parser builds them, so a test that needs an
argument object gets every flag's default (and a flag added later) without listing the flags by hand.
"""
import train


def train_args(*argv, **fields):
    """train.parse_args(["--task", "listops", "--sar", "0", "--device", "cpu", *argv]): the parser, its defaults
    (train.DEMO's, with the demo's SAR off unless asked for, on the CPU also on a GPU machine) and `given`; then
    `fields` set on it by name, for values that have no flag of their own. e.g. train_args("--sar", "1.0"),
    train_args("--task", "stsb", "--batch-size", "16")."""
    args = train.parse_args(["--task", "listops", "--sar", "0", "--device", "cpu", *argv])  # a later flag wins
    for k, v in fields.items():
        if not hasattr(args, k):
            raise AttributeError(f"train.py has no flag for {k!r}")  # a typo must not pass silently
        setattr(args, k, v)
    return args

"""An argparse parser whose usage errors raise instead of exiting with status 2 and the usage text,
so a CLI can report every bad input the same way: one line on stderr and status 1."""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A command line that does not parse; the message says what is wrong."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse calls this for every parse error
        raise UsageError(message)

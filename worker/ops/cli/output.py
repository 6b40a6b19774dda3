"""What commands print: one line at a time, escaped, so that what a message, a row or a broker
carried can neither add lines nor drive the terminal; summaries by value; the ``--verbose`` flag."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TextIO

from worker import logs


def show(line: str, file: TextIO | None = None) -> None:
    """Print one line of output with its control characters escaped (``logs.printable``) and URL
    passwords redacted: what a message, a row or a broker carried can neither add lines nor drive
    the terminal."""
    print(logs.redact_text(logs.printable(line)), file=file)


def summary(title: str, counts: Counter[str]) -> None:
    """One line per distinct value of ``counts``, most frequent first."""
    for value, count in counts.most_common():
        show(f"{title}: {value}: {count}")


def verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="a line per message or row, not only totals"
    )

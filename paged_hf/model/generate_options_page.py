"""Writes the README's "which generate options run" table from paged_hf/model/generate_options.py.

    python -m paged_hf.model.generate_options_page --readme README.md   # rewrite it between its markers
    python -m paged_hf.model.generate_options_page                      # print it
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate_options import TABLE_END, TABLE_START, render_table


def write_readme(path: str | Path) -> None:
    path = Path(path)
    text = path.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(head + render_table() + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_hf.model.generate_options_page", description=__doc__.split("\n")[0])
    parser.add_argument("--readme", help="rewrite the table between its markers in this file")
    args = parser.parse_args(argv)
    if args.readme:
        write_readme(args.readme)
    else:
        print(render_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

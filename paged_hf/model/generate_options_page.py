"""Writes docs/generate.md's "which generate options run" table from paged_hf/model/generate_options.py.

python -m paged_hf.model.generate_options_page --page docs/generate.md   # rewrite it between its markers
python -m paged_hf.model.generate_options_page                           # print it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate_options import TABLE_END, TABLE_START, render_table


def write_page(path: str | Path) -> None:
    path = Path(path)
    text = path.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(head + render_table() + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_hf.model.generate_options_page", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--page", help="rewrite the table between its markers in this file")
    args = parser.parse_args(argv)
    if args.page:
        write_page(args.page)
    else:
        print(render_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

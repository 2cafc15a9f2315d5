"""Build a sqlite database from a SQL script: `python -m vcpo_sqlite_tool.make_database SCRIPT.sql FILE`.

The example ships `shop.sql` instead of a binary database; this turns it into the file a task's
`tool.database` names. An existing FILE is replaced (the script is the source of truth), atomically:
the new database is written beside it and moved into place, so a failed script leaves no half file.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from pathlib import Path


def make_database(script: Path, database: Path) -> Path:
    """Run `script` on a new database at `database` (replacing any old one); returns the path."""
    database.parent.mkdir(parents=True, exist_ok=True)
    partial = database.with_name(database.name + ".partial")
    partial.unlink(missing_ok=True)
    connection = sqlite3.connect(partial)
    try:
        connection.executescript(script.read_text(encoding="utf-8"))
        connection.commit()
    finally:
        connection.close()
    os.replace(partial, database)
    return database


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo_sqlite_tool.make_database", description=__doc__)
    parser.add_argument("script", type=Path, help="SQL script, e.g. examples/sqlite_tool/shop.sql")
    parser.add_argument("database", type=Path,
                        help="sqlite file to write, e.g. examples/sqlite_tool/shop.sqlite")
    args = parser.parse_args(argv)
    try:
        path = make_database(args.script, args.database)
    except (OSError, sqlite3.Error) as error:
        print(f"error: {args.script}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

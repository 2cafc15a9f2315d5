"""A read-only SQL tool over sqlite for vcpo agent tasks, installed as a plug-in.

Registers two tools in the `vcpo.tools` entry-point group (pyproject.toml): `sqlite` (queries run
in-process) and `sqlite_sandboxed` (queries run in vcpo's bubblewrap sandbox), both in
`vcpo_sqlite_tool.tools`. A task uses one with `tool: {type: sqlite, database: path/to/file.sqlite}`;
the model writes ```` ```sql ```` blocks. `vcpo_sqlite_tool.query` is the query runner both share
(standard library only); `python -m vcpo_sqlite_tool.make_database` builds a database from a SQL
script. Importing this package imports nothing else (not vcpo), so the builder runs anywhere.
"""

__all__: list[str] = []

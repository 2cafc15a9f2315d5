"""Typed configuration: pydantic schemas (importing only pydantic), the YAML loader with
`a.b.c=value` overrides, and the shipped YAML files (runs, tasks, models, benchmarks).

May import: nothing of the project (pydantic and yaml)."""

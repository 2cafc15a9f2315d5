"""Which schema validates which shipped YAML file (by folder), for `vcpo config check` and tests."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from configs.schema import OpobBenchConfig, RunConfig

CONFIG_ROOT = Path(__file__).resolve().parent

_SCHEMAS_BY_FOLDER: dict[str, type[BaseModel]] = {
    "bench": OpobBenchConfig,
}


def schema_for(path: Path) -> type[BaseModel]:
    """The schema of a YAML file under configs/: by its first sub-folder, else the run config."""
    relative = Path(path).resolve().relative_to(CONFIG_ROOT)
    folder = relative.parts[0] if len(relative.parts) > 1 else ""
    return _SCHEMAS_BY_FOLDER.get(folder, RunConfig)


def shipped_config_files() -> list[Path]:
    """Every YAML file shipped under configs/."""
    return sorted(p for p in CONFIG_ROOT.rglob("*.yaml") if p.is_file())

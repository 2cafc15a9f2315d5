"""Which schema validates which shipped YAML file, for `vcpo config check` and the tests.

Lives in the composition layer because it joins schemas from several layers (run configs from
`configs/`, tool specs from `tools/`); `configs/` itself stays pydantic-only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import configs
from configs.loader import ConfigError, load_config, read_yaml_tree
from configs.schema import OpobBenchConfig, RunConfig
from tools.base import ToolConfigError
from tools.registry import validate_tool_settings
from tools.settings import SandboxServerSettings

CONFIG_ROOT = Path(configs.__file__).resolve().parent


def _tool_spec(path: Path) -> Any:
    try:
        return validate_tool_settings(read_yaml_tree(path))[1]
    except ToolConfigError as exc:
        raise ConfigError(str(path), [str(exc)]) from None


_VALIDATORS: dict[str, Callable[[Path], Any]] = {
    "bench": lambda path: load_config(path, OpobBenchConfig),
    "sandbox": lambda path: load_config(path, SandboxServerSettings),
    "tools": _tool_spec,
}


def validate_shipped_file(path: Path) -> Any:
    """Validate a YAML file under configs/ with the schema of its first sub-folder (else a run)."""
    relative = Path(path).resolve().relative_to(CONFIG_ROOT)
    folder = relative.parts[0] if len(relative.parts) > 1 else ""
    return _VALIDATORS.get(folder, lambda p: load_config(p, RunConfig))(path)


def shipped_config_files() -> list[Path]:
    """Every YAML file shipped under configs/."""
    return sorted(p for p in CONFIG_ROOT.rglob("*.yaml") if p.is_file())

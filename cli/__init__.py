"""The `vcpo` command (`main`): argument parsing and each subcommand's wiring, with `vcpo config check`'s
catalogue of shipped YAML files (`config_catalog`) and `vcpo eval` (`eval_command`); `console` is the
installed script, which first picks the memory allocator (`run.launch.allocator`).

May import: `vcpo`, `configs`, `tools`, `rollout`, `agent_env`, `learner`, `run`, `benchmarks` — it is the
top of the composition root, the one layer that may reach every other; subcommands import lazily so the
command's help stays instant.
"""

from cli.main import main
from run.launch.allocator import prefer_tcmalloc

__all__ = ["console", "main"]


def console() -> int:
    """The installed `vcpo` script and `python -m cli`: `main` on the preferred allocator.

    Separate from `main` because choosing the allocator may re-execute the process, which code that
    calls `main(argv)` in-process (tests, notebooks) must never see."""
    prefer_tcmalloc()
    return main()

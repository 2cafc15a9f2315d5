"""The `vcpo` command (`main`): argument parsing and each subcommand's wiring, with `vcpo config check`'s
catalogue of shipped YAML files (`config_catalog`) and `vcpo eval` (`eval_command`); `console` is the
installed script, which first picks the memory allocator (`learner.launch.allocator`).

May import: `learner.launch`, `learner.benchmarks`, `learner.train`, `learner.backends`,
`learner.backends.megatron`, `learner.traj_grads`, `learner.forward`, `learner.distributed`,
`learner.observability` (it is the composition root's top); subcommands import lazily so the command's
help stays instant.
"""

from learner.cli.main import main
from learner.launch.allocator import prefer_tcmalloc

__all__ = ["console", "main"]


def console() -> int:
    """The installed `vcpo` script and `python -m learner.cli`: `main` on the preferred allocator.

    Separate from `main` because choosing the allocator may re-execute the process, which code that
    calls `main(argv)` in-process (tests, notebooks) must never see."""
    prefer_tcmalloc()
    return main()

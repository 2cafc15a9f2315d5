"""Where vcpo's own terminal output goes, and keeping library chatter out of it.

A training run loads vLLM, transformers and torch, which write to the process's stderr from Python
(logging, tqdm bars, warnings) and from C++ (torch's `W1124 …` lines, oneDNN, vLLM's worker):
~40 lines before the first step and a few per weight reload ("Reloading weights inplace…",
"RotaryEmbedding: Failed to load weights" — expected: the rotary and tied `lm_head` modules have no
weights of their own in the checkpoint, so vLLM's in-place reload skips them). Those interleave with
the progress line and read like alarms.

`divert_library_output(path)` points file descriptor 2 at `path` for the duration of a block, so
everything written to stderr — by any library, in any language — lands in that log file, and hands
back a stream on the original stderr: `terminal()`. vcpo's progress line, its messages and its own
loggers' warnings (`vcpo`, `learner`, `rollout`, `tools`, `agent_env`, `configs`) are written there.
Outside a diverted block `terminal()` is simply `sys.stderr`. stdout is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

OWN_LOGGERS = ("vcpo", "run", "learner", "rollout", "tools", "agent_env", "configs")
"""Logger names whose warnings are vcpo's own messages (shown on the terminal)."""

_terminal: TextIO | None = None


def terminal() -> TextIO:
    """The stream for vcpo's own output: the real terminal while library output is diverted."""
    return _terminal if _terminal is not None else sys.stderr


class _OwnRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] in OWN_LOGGERS


@contextlib.contextmanager
def divert_library_output(path: Path, *, level: int = logging.WARNING) -> Iterator[TextIO]:
    """Send the process's stderr (fd 2) to `path` (appended) inside the block; yield the terminal.

    Also: the root logger writes everything at INFO and above to the file, and vcpo's own loggers'
    records at `level` and above go to the terminal. On leaving (also by an exception, whose
    traceback then prints on the real terminal) fd 2 and the logging handlers are restored.
    """
    global _terminal
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved_fd = os.dup(2)
    console = os.fdopen(os.dup(saved_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    log_file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    os.dup2(log_file.fileno(), 2)
    root = logging.getLogger()
    saved_level = root.level
    to_terminal = logging.StreamHandler(console)
    to_terminal.setLevel(level)
    to_terminal.addFilter(_OwnRecords())
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_terminal)
    root.setLevel(min(saved_level or logging.WARNING, logging.INFO))
    for chatty in ("httpx", "httpcore", "urllib3", "filelock"):  # a line per request / lock in the file
        logging.getLogger(chatty).setLevel(logging.WARNING)
    _terminal = console
    try:
        yield console
    finally:
        _terminal = None
        root.removeHandler(to_terminal)
        root.setLevel(saved_level)
        sys.stderr.flush()
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        log_file.close()
        console.flush()
        console.close()

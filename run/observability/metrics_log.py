"""Per-step training metrics on disk: `run_dir/metrics.jsonl` (the record of truth), TensorBoard
scalars under `run_dir/tensorboard`, and optionally Weights & Biases.

One JSON object per line and per training step: `{"trainer_step", "policy_version", "wall_s",
<metric keys from run.observability.metric_names>}`. Non-finite floats are written as null. Each line is
flushed and fsync'ed before `log` returns, so a killed run loses at most the line being written;
readers drop such a torn last line. Resuming from a checkpoint at step N removes the lines after N,
so the resumed run does not log steps N+1.. twice (TensorBoard is told the same with `purge_step`).

This module does not compute, reduce or choose metrics (the trainer does), and it is not
thread-safe: one `MetricsLogger` writes a run directory at a time. `log` blocks its caller for one
fsync (about a millisecond on local disks), negligible against a training step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from run.observability.metric_names import (
    AXES,
    POLICY_VERSION,
    STALENESS_HIST,
    TRAINER_STEP,
    WALL_S,
    staleness_bin_label,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"

MetricValue = float | int | list[int] | list[float]


class MetricsFileError(ValueError):
    """metrics.jsonl is missing, empty where records are needed, corrupt, or would be overwritten."""


def no_metrics_message(run_dir: Path) -> str:
    return f"no metrics in {run_dir / METRICS_FILE} — has `vcpo train` logged a step?"


# ---------------------------------------------------------------------------------------------
# Reading


def _complete_lines(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The file's complete records: (raw lines with their newline, parsed objects).

    A record is a line that ends in a newline and parses as a JSON object. The last line may be
    torn (the writer was killed mid-write, or a crash left it unterminated or zero-filled) and is
    dropped; a bad line anywhere else means the file was damaged or edited and raises.
    """
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    raw: list[str] = []
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        is_last = number == len(lines)
        if not line.strip():
            continue
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or TRAINER_STEP not in record:
            if is_last:
                log.warning("%s: dropping a torn last line (%d bytes)", path, len(line.encode()))
                continue
            raise MetricsFileError(
                f"{path}:{number} is not a JSON metrics record ({line[:80]!r}); the file was damaged "
                "or edited — remove or fix that line")
        raw.append(line)
        records.append(record)
    return raw, records


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of `run_dir/metrics.jsonl`, in file order (a torn last line is dropped,
    so this is safe to call while a run is writing). Missing values are None (logged as null)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsFileError(no_metrics_message(Path(run_dir)))
    return _complete_lines(path)[1]


# ---------------------------------------------------------------------------------------------
# Value conversion


def _scalar(key: str, value: Any) -> float | int | None:
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()  # 0-d tensor or numpy scalar
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r}: expected a number or a list of numbers, got {type(value).__name__}")


def _json_value(key: str, value: Any) -> float | int | list[float | int | None] | None:
    """A metric as JSON can hold it: numbers stay, non-finite floats become None, tensors and numpy
    arrays become numbers or lists (1-d only)."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_scalar(key, item) for item in value]
    return _scalar(key, value)


def _hist_labels(key: str, count: int) -> list[str]:
    """Tag suffixes for a list-valued metric's entries: lag bins for staleness/hist and the per-lag
    metrics (`…_by_lag`, e.g. correction/rejected_tokens_by_lag), else indices."""
    if key == STALENESS_HIST or key.endswith("_by_lag"):
        width = len(str(2 ** max(count - 2, 0)))
        return [staleness_bin_label(index, count, width=width) for index in range(count)]
    return [str(index) for index in range(count)]


def dashboard_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Flat scalars for TensorBoard / W&B: list entries become `<key>/<bin label>` (for staleness/hist
    `staleness/hist/000`, `.../002-003`, ..., `.../128+`: one chart per lag bin, sorted in bin order);
    None becomes NaN (dashboards show it as a gap or a marker). The step axis is dropped."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        if key in (TRAINER_STEP, WALL_S):
            continue
        if isinstance(value, list):
            for label, item in zip(_hist_labels(key, len(value)), value, strict=True):
                flat[f"{key}/{label}"] = math.nan if item is None else float(item)
        else:
            flat[key] = math.nan if value is None else float(value)
    return flat


# ---------------------------------------------------------------------------------------------
# Writing


class MetricsLogger:
    """Appends one record per training step to metrics.jsonl and mirrors it to TensorBoard / W&B.

    run_dir: created if missing. resume_from_step: None starts a new run (refused if metrics.jsonl
    already holds records — pick a new run_dir or resume); N continues a run from its checkpoint at
    trainer_step N, dropping the records after N and continuing wall_s from the last kept record.
    use_tensorboard: when tensorboard is not installed, warns once and logs JSONL only.
    use_wandb: needs the `wandb` package (clear ImportError otherwise); the W&B run id is kept in
    run_dir/wandb_run_id so a resumed run continues the same W&B run.

    A context manager (sync or async): leaving it closes the files. Construction opens them.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        resume_from_step: int | None = None,
        use_tensorboard: bool = True,
        use_wandb: bool = False,
        wandb_project: str = "vcpo",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        kept = self._prepare_file(resume_from_step)
        self._last_step = max((int(r[TRAINER_STEP]) for r in kept), default=None)
        self._wall_offset_s = float(kept[-1].get(WALL_S) or 0.0) if kept else 0.0
        self._start_s = time.monotonic()
        self._file = self.path.open("a", encoding="utf-8")
        purge_step = None if resume_from_step is None else resume_from_step + 1
        self._tensorboard = (_open_tensorboard(self.run_dir / TENSORBOARD_DIR, purge_step)
                             if use_tensorboard else None)
        self._wandb = (_start_wandb(self.run_dir, wandb_project, is_resume=resume_from_step is not None)
                       if use_wandb else None)

    def _prepare_file(self, resume_from_step: int | None) -> list[dict[str, Any]]:
        """Make metrics.jsonl hold exactly the records to keep; return them."""
        if not self.path.is_file():
            if resume_from_step:  # step 0 = a fresh start, nothing was expected
                log.warning("resuming at step %d but %s does not exist; starting it",
                            resume_from_step, self.path)
            return []
        raw, records = _complete_lines(self.path)
        if resume_from_step is None:
            if records:
                raise MetricsFileError(
                    f"{self.path} already holds {len(records)} steps (last trainer_step "
                    f"{records[-1][TRAINER_STEP]}); resume from a checkpoint (resume_from_step=N) or "
                    "use a new run_dir")
            raw, records = [], []
        else:
            kept = [(line, record) for line, record in zip(raw, records, strict=True)
                    if record[TRAINER_STEP] <= resume_from_step]
            if len(kept) < len(records):
                log.info("resume at step %d: dropping %d logged steps after it from %s",
                         resume_from_step, len(records) - len(kept), self.path)
            raw, records = [line for line, _ in kept], [r for _, r in kept]
        atomic_write_text(self.path, "".join(raw))
        return records

    @property
    def last_step(self) -> int | None:
        """The last trainer_step in metrics.jsonl (kept on resume or logged since), None when empty."""
        return self._last_step

    def log(self, step: int, policy_version: int, metrics: Mapping[str, MetricValue]) -> None:
        """Write the record of training step `step` (must exceed every step logged before).

        metrics: key → number or list of numbers (0-d / 1-d tensors and numpy values are accepted).
        Returns once the line is on disk.
        """
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"trainer_step {step} was already logged (last logged step {self._last_step}); "
                             "steps must increase — on resume pass resume_from_step")
        clash = sorted(set(metrics) & set(AXES))
        if clash:
            raise ValueError(f"metrics must not contain the axis keys {clash}; pass them as arguments")
        wall_s = self._wall_offset_s + time.monotonic() - self._start_s
        record: dict[str, Any] = {TRAINER_STEP: int(step), POLICY_VERSION: int(policy_version),
                                  WALL_S: round(wall_s, 3)}
        record.update({key: _json_value(key, value) for key, value in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_step = int(step)

        if self._tensorboard is not None or self._wandb is not None:
            scalars = dashboard_scalars(record)
            if self._tensorboard is not None:
                for key, value in scalars.items():
                    self._tensorboard.add_scalar(key, value, global_step=step)
                self._tensorboard.flush()
            if self._wandb is not None:
                self._wandb.log({**scalars, WALL_S: record[WALL_S]}, step=step)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> MetricsLogger:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _open_tensorboard(log_dir: Path, purge_step: int | None) -> Any:
    """A SummaryWriter, or None (with one warning) when tensorboard is not installed.

    purge_step: on resume, TensorBoard hides the events at steps ≥ it written by the earlier run.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        log.warning("TensorBoard logging is off: %s. Metrics go to metrics.jsonl only "
                    "(pip install tensorboard to enable it).", exc)
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _start_wandb(run_dir: Path, project: str, *, is_resume: bool) -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("use_wandb=True needs the wandb package: `pip install wandb`, "
                          "or set use_wandb=False (TensorBoard and metrics.jsonl still log)") from exc
    id_path = run_dir / WANDB_ID_FILE
    run_id = id_path.read_text().strip() if is_resume and id_path.is_file() else wandb.util.generate_id()
    id_path.write_text(run_id + "\n")
    return wandb.init(project=project, name=run_dir.name, id=run_id, dir=str(run_dir), resume="allow")

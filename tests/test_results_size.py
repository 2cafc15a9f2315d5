"""docs/results/ stays small: what is committed there is the summaries and the small files they are recomputed
from (docs/results.md says what and why); a benchmark that outgrows the budgets must keep less."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MAX_FILE_BYTES = 512 * 1024
MAX_TOTAL_BYTES = 40 * 1024 * 1024
ALLOWED_LARGE = ("staleness_runs/policy-",)
"""The synthetic staleness preset's starting policy: the one model committed (every cell starts from it)."""


def _files() -> list[Path]:
    return [path for path in RESULTS.rglob("*") if path.is_file()]


def test_no_committed_result_file_is_large() -> None:
    large = [f"{path.relative_to(RESULTS)} ({path.stat().st_size // 1024} KB)" for path in _files()
             if path.stat().st_size > MAX_FILE_BYTES
             and not str(path.relative_to(RESULTS)).startswith(ALLOWED_LARGE)]
    assert not large, f"over {MAX_FILE_BYTES // 1024} KB: {large}; keep fewer rows (docs/results.md)"


def test_the_results_folder_stays_under_its_budget() -> None:
    total = sum(path.stat().st_size for path in _files())
    assert total <= MAX_TOTAL_BYTES, (f"docs/results/ holds {total / 2**20:.1f} MB, over "
                                      f"{MAX_TOTAL_BYTES / 2**20:.0f} MB; see docs/results.md's policy")

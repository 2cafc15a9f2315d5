"""`vcpo bench`: the benchmarks, out of the product packages. Each prints JSON; none is a test.

* `main_job` — the main job on its fixed seeds, the evidence of its claim (`main_job`)
* `staleness` — methods × lag bounds × seeds on synthetic tasks with pre-taught policies
  (`staleness/`: `bench`, `tasks`, `schema`)
* `async` — wall time of one workload at several lag bounds (`asynchrony`, with `step_mix`)
* `learner` — optimizer steps of each learner backend and their kernel floor (`learner_step`,
  `kernel_floor`, `workload`)
* `opob` — the cost of a VCPO step against a GRPO step (`opob_step`)
* `engine` — tokens/s of every engine backend against HF `generate`, each in a worker process
  (`engine`, `engine_worker`)
* `sandbox` — the local sandbox's latency and throughput against a bare `python3 -c` (`sandbox`)

`schema` holds their configurations, `configs/` (`BENCH_CONFIG_ROOT`) the shipped presets, and
`results_page` renders docs/results.md's, docs/performance.md's and the README's tables from the committed
JSON.

May import: `vcpo`, `configs`, `tools`, `rollout`, `agent_env`, `learner`, `run`. The `vcpo` command above it
imports a benchmark only when it runs one.

Its top modules may import: `benchmarks.staleness` (the results page renders the staleness tables).
"""

from pathlib import Path

BENCH_CONFIG_ROOT = Path(__file__).resolve().parent / "configs"
"""The shipped benchmark configs: `<name>.yaml` (or a preset `<name>_<variant>.yaml`) for
`vcpo bench <name>`."""

"""The algorithm: pure functions on tensors (IS weights, ESS, step-size rules, OPOB, advantages,
policy objectives, loss aggregation, staleness/IS metrics). Imports torch only: no I/O, no models,
no processes, no config objects. docs/algorithm.md is the math this implements.

Modules: `is_weights` (log-ratios, IS weights, their truncation, the ESS), `step_size` (the ESS and
staleness step-size rules), `opob` (the off-policy optimal baseline), `otb` (the optimal token baseline),
`advantages` and `groups` (group statistics), `objectives/` (one policy objective per class, the registry's
by name), `policy_losses` and `aggregation` (per-token losses and their reduction), `corrections`
(truncation and rejection stages under any objective), `stabilizers` (M2PO's and BAPO's masks and
bounds), `regularizers` (KL and entropy terms), `registry` (objectives and step-size rules by name),
`metrics` (staleness and IS metrics).

The package holds no re-exports: import from the module that defines a name.

May import: nothing of the project (torch and the standard library only).

Its top modules may import: `vcpo.objectives` (the registry builds objectives by name)."""

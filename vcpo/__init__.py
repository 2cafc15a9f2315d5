"""The algorithm: pure functions on tensors (IS weights, ESS, step-size rules, OPOB, advantages,
policy objectives, loss aggregation, staleness/IS metrics). Imports torch only: no I/O, no models,
no processes, no config objects. See ../shared/docs/VCPO.md for the math this implements."""

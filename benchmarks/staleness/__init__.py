"""`vcpo bench staleness`: does an objective stay stable as the lag k grows? `bench` runs the matrix
(methods × k × seeds) and summarizes it; `tasks` holds the synthetic preset's tasks and pre-taught policy;
`schema` the presets' schemas.

May import: `vcpo` (metric keys), `configs`, `rollout`,
`agent_env`, `learner` (each run trains through the real pipeline).
"""

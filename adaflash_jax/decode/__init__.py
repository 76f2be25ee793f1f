"""Decoding: plain batched generation (`generate.py`), and the speculative engine
(docs/design.md §5), outside in: `slots.py` (host scheduler, `SpeculativeEngine`),
`programs.py` (jitted entry points), `loops.py` (the drafted and undrafted loop programs),
`step.py` (one step), `drafting.py` / `verify.py` / `acceptance.py` (its parts),
`undrafted.py` (deferred context, probes), `state.py` (state, static spec), `policy.py`
(length policies: the protocol, fixed, adaflash), `goodput/` (reads its step costs from
`io/cost_table.py`), `build.py` (engines and policies by name), `tokens.py` (sampling,
committing).
"""

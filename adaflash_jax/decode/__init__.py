"""Decoding: plain batched generation, and the speculative engine (docs/design.md §5).

Engine, outside in: `slots.py` (host scheduler, `SpeculativeEngine`), `programs.py` (the
jitted entry points), `step.py` (one step, the drafted loop), `drafting.py` / `verify.py` /
`acceptance.py` (its halves), `state.py` (state and static spec), `policy.py` (the length
policy protocol, fixed and adaflash), `goodput/` (the goodput policy), `build.py` (engines
and policies by name), `tokens.py` (sampling and committing tokens).
"""

"""Goodput: the verify width that maximises expected committed tokens per millisecond of the
engine's own step, with a "don't speculate" arm (our policy, not the paper's).

- `policy.py`: `GoodputPolicy` (the `LengthPolicy` protocol), its acceptance estimators.
- `calibration.py`: each row's calibration of the estimates to its realised acceptance.
- `skip.py`: the skip arm's loop programs (undrafted steps, probes, the deferred context).

Its cost table: `decode/cost_table.py` (measured by `bench/step_cost.py`).
"""

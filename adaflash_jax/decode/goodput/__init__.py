"""Goodput: the verify width that maximises expected committed tokens per millisecond of the
engine's own step (`io/cost_table.py`), with a "don't speculate" arm (our policy, not the
paper's): `policy.py` (`GoodputPolicy`, acceptance estimators), `calibration.py` (each row's
estimates calibrated to its realised acceptance). The engine runs the arm's undrafted steps
and probes (`decode/undrafted.py`, `decode/loops.py`); the policy only answers.
"""

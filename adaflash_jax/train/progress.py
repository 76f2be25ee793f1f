"""A tqdm progress bar showing loss and tokens/s (process 0 only)."""

from __future__ import annotations

import time


class Progress:
    def __init__(
        self,
        *,
        total: int,
        initial: int = 0,
        tokens_per_step: int,
        desc: str = "train",
        enabled: bool | None = None,
    ):
        from tqdm.auto import tqdm

        if enabled is None:
            import jax

            enabled = jax.process_index() == 0
        self.tokens_per_step = tokens_per_step
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            disable=not enabled,
            dynamic_ncols=True,
            unit="step",
        )
        self._t0 = time.perf_counter()
        self._steps = 0

    def update(self, n: int = 1, **metrics: float) -> float:
        """Advances the bar; returns the tokens/s measured since the bar started."""
        self._steps += n
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        tok_s = self._steps * self.tokens_per_step / elapsed
        shown = {k: f"{float(v):.4g}" for k, v in metrics.items()}
        shown["tok/s"] = f"{tok_s:,.0f}"
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(n)
        return tok_s

    def restart_clock(self) -> None:
        """Excludes compile time from tokens/s: call after the first (compiling) step."""
        self._t0, self._steps = time.perf_counter(), 0

    def close(self) -> None:
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""Length-policy test doubles: decisions on a fixed schedule, so tests get runs that mix
drafted and undrafted steps whatever the models' acceptance estimates say."""

import dataclasses

import jax.numpy as jnp

from adaflash_jax.decode.policies import GoodputPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftEveryNth(GoodputPolicy):
    """Goodput's widths and estimates, but drafting once `n` undrafted steps ran, and no
    probes. The undrafted program asks only between runs of steps (a flush, a probe or a
    finished row), so an engine with `pending_steps=n` drafts after every `n`."""

    n: int = 2

    def speculate(
        self, accept_BxKm1, active_B, undrafted, *, buckets, log_gamma=0.0, switching=False
    ):
        return undrafted >= self.n

    def probe_interval(self, num_running, buckets, **_):
        return jnp.asarray(jnp.iinfo(jnp.int32).max, jnp.int32)

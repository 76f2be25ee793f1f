"""The engine's two loop programs: drafted steps, and undrafted steps with probes (docs/design.md
§5, §5.4).

Dimensions: B slots.

`drafted_loop` runs drafted steps (plain ones without a drafter) while the policy's
`speculate` says draft. `undrafted_loop` runs plain steps that defer the drafter context
(`undrafted.py`), with a probe whenever the policy's answer says one is due; it asks the policy
only between runs of steps (after a probe, a flush or a finished row): nothing the answer
reads changes within a run, and asking in every step's loop check costs the undrafted step.
Each program exits when the policy wants the other, and the host switches (`slots.py`), so no
step pays for a conditional around the drafter (nor for the cache copies XLA makes around
conditionally updated buffers). Only a policy with `may_skip` ever leaves the drafted loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode.policy import Decision, Outcome
from adaflash_jax.decode.step import drafted_step, plain_step
from adaflash_jax.decode.undrafted import flush, grade_probe, pending_full, probe, undrafted_step

DRAFTED, UNDRAFTED = 0, 1  # program indices into PROGRAMS


def admit(s, spec):
    """Tells the policy which rows took new requests since it last looked (a loop's entry);
    their deferred entries and probe belonged to the old request."""
    policy_state = spec.policy.observe(Outcome(started_B=s.started_B), s.policy_state)
    return s.replace(
        policy_state=policy_state,
        undrafted=s.undrafted.admitted(s.started_B),
        started_B=jnp.zeros_like(s.started_B),
    )


def decide(s, spec, switching: bool) -> Decision:
    """The policy's answer now; `switching`: asked from the undrafted loop."""
    return spec.policy.speculate(
        s.policy_state,
        ~s.done_B,
        undrafted=s.undrafted.steps,
        switching=switching,
        buckets=spec.buckets,
        token_buckets=spec.token_buckets,
    )


def may_continue(carry, stop_on_finish, max_steps):
    """A loop carry (state, steps run, rows finished) may take another step: a row is
    active, `max_steps` did not run yet, and no row finished if `stop_on_finish`."""
    s, it, finished = carry
    return jnp.any(~s.done_B) & (it < max_steps) & ~(stop_on_finish & (finished > 0))


def counting(step):
    """`step` (state → state) as a loop body over (state, steps run, rows finished)."""

    def body(carry):
        s, it, finished = carry
        before_B = ~s.done_B
        s = step(s)
        return s, it + 1, finished + jnp.sum((before_B & s.done_B).astype(jnp.int32))

    return body


def next_program(s, spec, switching: bool):
    return jnp.where(decide(s, spec, switching).draft, DRAFTED, UNDRAFTED)


def drafted_loop(target, drafter, s, spec, stop_on_finish, max_steps):
    """Drafted steps (plain ones without a drafter) while `may_continue` and the policy
    drafts; a skipping policy's deferred context is flushed and its latest probe graded on
    entry. Returns (state, steps run, slots finished, the program to run next)."""
    s = admit(s, spec)
    if drafter is not None and spec.policy.may_skip:
        s = grade_probe(flush(drafter, s), spec)

    def step(s):
        if drafter is None:
            return plain_step(target, s, spec, requested=1)[0]
        return drafted_step(target, drafter, s, spec)

    def drafting(c):
        return may_continue(c, stop_on_finish, max_steps) & decide(c[0], spec, False).draft

    carry = (s, jnp.int32(0), jnp.int32(0))
    s, steps, finished = jax.lax.while_loop(drafting, counting(step), carry)
    return s, steps, finished, next_program(s, spec, False)


def _between_runs(target, drafter, s, spec):
    """Flushes the context for a due probe or a full buffer, probes if due, and asks when
    the next probe is due (decided here, between runs of steps, not in every step)."""
    due = s.undrafted.steps >= decide(s, spec, True).probe_in
    s = flush(drafter, s, due | pending_full(s))

    def small(s):  # what a probe changes: no cache or feature buffer flows through the cond
        return s.probes, s.policy_state, s.undrafted.replace(pending_BxUxnD=None)

    probes, policy_state, u = jax.lax.cond(
        due, lambda: small(probe(target, drafter, s, spec)), lambda: small(s)
    )
    u = u.replace(pending_BxUxnD=s.undrafted.pending_BxUxnD)
    s = s.replace(probes=probes, policy_state=policy_state, undrafted=u)
    return s.replace(undrafted=u.replace(probe_due_at=decide(s, spec, True).probe_in))


def undrafted_loop(target, drafter, s, spec, stop_on_finish, max_steps):
    """Runs of undrafted steps, each until the buffer fills, a probe is due, a row finishes
    or the loop would stop, while the policy does not draft. A due probe (e.g. before any
    drafter forward) comes before the first answer."""
    step = counting(lambda s: undrafted_step(target, s, spec))

    def run(carry):
        finished0 = carry[2]

        def more(c):
            u = c[0].undrafted
            ok = may_continue(c, stop_on_finish, max_steps) & (c[2] == finished0)
            return ok & ~pending_full(c[0]) & (u.steps < u.probe_due_at)

        s, it, finished = jax.lax.while_loop(more, step, carry)
        return _between_runs(target, drafter, s, spec), it, finished

    def undrafted(c):
        return may_continue(c, stop_on_finish, max_steps) & ~decide(c[0], spec, True).draft

    carry = (_between_runs(target, drafter, admit(s, spec), spec), jnp.int32(0), jnp.int32(0))
    s, steps, finished = jax.lax.while_loop(undrafted, run, carry)
    return s, steps, finished, next_program(s, spec, True)


PROGRAMS = (drafted_loop, undrafted_loop)

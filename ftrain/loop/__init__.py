"""The training loop: a generator of events you can drive from a notebook.

::

    lp = ftrain.Loop(step, state, data, hooks=ftrain.default_hooks(), epochs=3,
                     work_dir="runs/exp1", resume="auto")
    state = lp.run()                  # train to the end (a script), or:
    lp.run(steps=500)                 # 500 more updates, then pause (hooks stay open)
    for ev in lp:                     # every event, after all hooks saw it (a notebook)
        ...
    state = lp.state                  # the newest consistent state

What runs when (one call of ``next`` on the loop)::

    first iteration:   resume (state, data position, hook state) if asked
                       hooks start in priority order       (code before their loop)
                       RunBegin; then the loop reads the hooks' cadences
    each epoch:        sampler.set_epoch(epoch); EpochBegin
    each micro-batch:  batch = next(data)                  (data_time)
                       state, metrics = step(state, batch)
                       loop.totals counts it: times, metrics (no host sync)
                       StepEnd(state, metrics, is_update, data_time, iter_time)
                         (only at updates some hook's cadence is due at, unless
                         you iterate the loop yourself or a hook has no cadence;
                         always when a stop is held or max_steps is reached)
                       stop here if max_steps is reached or a hook asked to stop
                       (Evaluated: added by an evaluation hook, seen by later hooks)
    run(steps=N) done: Paused; the next event comes when run() continues
    end of the data:   step.flush(state) applies a partial accumulation window
                       (a StepEnd with is_update=True); state.epoch += 1; EpochEnd
    the end:           RunEnd; hooks finish in priority order (code after their loop)
                       (no RunEnd on an interruption: only each hook's ``finally``)

Interrupting (Ctrl-C, SIGTERM, SIGUSR1) stops at a safe point: the signal is
held while the loop or a hook runs and raised once the running step's event
has passed every hook, so ``lp.state`` is consistent, every hook's ``finally``
has run (the auto-checkpoint saved exactly there) and iterating ``lp`` again
continues. SIGTERM/SIGUSR1 raise :class:`TerminatedError`. Under
``torch.distributed`` the ranks vote (:class:`ftrain._agreement.StopVote`), so all
stop after the same update.

The modules: :mod:`~ftrain.loop.core` (``Loop``, the hot loop), :mod:`~ftrain.loop.signals`
(held interrupts), :mod:`~ftrain.loop.data` (the data position), :mod:`~ftrain.loop.registry`
(open and paused loops). What hooks read of a run: :class:`ftrain.run.Run`.
"""

from ftrain.loop.core import CHECKPOINT_FORMAT, Loop
from ftrain.loop.signals import PREEMPTED_EXIT_CODE, TerminatedError

__all__ = ["Loop", "TerminatedError", "PREEMPTED_EXIT_CODE", "CHECKPOINT_FORMAT"]

"""The RL training step and its set-up: the run context (context.py), the named steps of the loop (steps.py), the
learner side of a step (update.py), whole-run checkpoints (state.py), the checks of the files a run points to
(preflight.py) and what a run shows (report.py). Where the rollouts come from is placement/; the run directory's
bookkeeping is run/."""

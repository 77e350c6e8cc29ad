"""The rollout service: where the engines are (placements.py: colocated, colocated with a shared engine,
disaggregated), the rollout ranks of a disaggregated run (disaggregated.py) and their messages (protocol.py),
sampling ahead of the learner (run_ahead.py), and the engine side of one step (rollout.py)."""

"""A run's bookkeeping: who owns a run directory (run_dir.py) and its lock (lock.py), what a resumed run may change
in its config (resume_config.py), and stopping a run safely (stops.py)."""

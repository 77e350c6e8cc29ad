"""Launchers: local torchrun and SLURM sbatch rendering/submission. No training logic lives here."""

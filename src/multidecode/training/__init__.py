"""Training learned drafters for a target model (see `distill`)."""

TRAINABLE = ("medusa", "eagle")
"""The learned drafters `train-drafter` trains (each with its trainee in `trainees`)."""

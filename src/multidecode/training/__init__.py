"""Training learned drafters for a target model (see `distill`)."""

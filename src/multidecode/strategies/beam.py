"""Beam search over one shared tree (placeholder: implemented in the beam-search change)."""

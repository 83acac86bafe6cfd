"""Writing in the margins (placeholder: implemented in the margins change)."""

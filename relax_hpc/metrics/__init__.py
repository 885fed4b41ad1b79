"""Metrics: JSONL files in RUN_DIR/metrics (one per role) and the launcher's live progress line."""

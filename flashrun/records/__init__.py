"""What flashrun keeps: atomic file writes, run records (``runs.jsonl``), key masking, and the
``runs`` listing."""

"""What flashrun keeps: atomic file writes (``files``), run records (``runs.jsonl``), key masking, and the
``runs`` listing."""

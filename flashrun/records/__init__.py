"""What flashrun keeps: atomic file writes (``files``), run records (``runlog``, ``runs.jsonl``),
key masking (``redact``), and the ``runs`` listing."""

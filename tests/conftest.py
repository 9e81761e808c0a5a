"""Shared test setup. CI has no GPU: kernels run through Triton's interpreter, which must be
chosen before anything imports triton's kernels."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

"""What this machine is: probes of the Python / PyTorch / CUDA / driver / Triton stack, the
``check-env`` verdicts on them with a fix hint each, the smoke kernel that proves the stack end
to end, and the fingerprint stored with every run record."""

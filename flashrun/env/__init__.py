"""``check-env``: probes of the Python / PyTorch / CUDA / driver / Triton stack, the verdicts on
them with a fix hint each, and the smoke kernel that proves the stack end to end."""

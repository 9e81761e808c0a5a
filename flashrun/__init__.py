"""flashrun: run, verify and benchmark FlashAttention-style Triton kernels.

Importing the package is cheap: torch and triton are imported only by the commands and
modules that need them (``flashrun.kernels``, ``flashrun.harness.reference``, ...).
"""

__version__ = "0.9.0"

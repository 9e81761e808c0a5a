"""The harness: shapes and their random inputs, the reference, the judge, and the two commands
built on them - ``verify`` (is a kernel right?) and ``bench`` (how fast is it?).

Nothing here is imported by :mod:`flashrun.kernels`; the harness calls kernels, never the reverse.
"""

"""What the kernels accept, defined once: the config, the cases files and the kernels' own
launchers all check against these. No torch here (the config imports it)."""

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # non powers of two are handled inside the kernels
# A verify case's dtype may also be e4m3: q, k, v in float8_e4m3fn with descales, a bf16 output
# (the fp8 forward); bench times that as the provider flash-fp8 on bf16 shapes instead.
FP8_DTYPE = "float8_e4m3fn"
# The short names flashrun prints in labels, accepted wherever a dtype is read.
SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", FP8_DTYPE: "e4m3"}
# bench providers that compute in e4m3 from a bf16 shape's inputs: their roof is the e4m3 matmul's
FP8_PROVIDERS = ("flash-fp8", "cudnn-fp8")
DTYPE_ALIASES = {short: name for name, short in SHORT_DTYPES.items()}
# flashrun's own kernels, by name (anything else is a user's PATH.py:FUNCTION);
# flash-deterministic: flash with its atomic-free, bitwise-repeatable backward;
# flash-atomic: flash with the 5-matmul backward that sums dQ with atomics.
BUILTIN_KERNELS = ("flash", "flash-deterministic", "flash-atomic", "minimal")
# Which of the two `flash` runs when nothing says (flash_attention(deterministic=...), [experiment]
# deterministic): the faster one on the H200, decided by measurement (NOTES) and
# switched here only. None: per call, the Gluon sm_90 kernel with dQ inside where it applies
# (non-deterministic; 1.07-1.15x the deterministic backward there, NOTES v10), else the
# deterministic kernels (the Triton atomic kernel measured slower than them, NOTES v5).
DETERMINISTIC_BACKWARD: bool | None = None
# The environment variables that change which kernels run (tuning on a table miss, the Gluon
# forward and backward and the backward's softcap/ALiBi, decode's programmatic dependent
# launches and its Gluon fp8 kernel): recorded with every result (flashrun.env.fingerprint) and
# forwarded to Ray workers (flashrun.harness.cluster).
KERNEL_SWITCHES = ("FLASHRUN_TUNE", "FLASHRUN_HOPPER", "FLASHRUN_HOPPER_BWD", "FLASHRUN_HOPPER_BWD_VARIANTS",
                   "FLASHRUN_HOPPER_BWD_FUSED_VARIANTS", "FLASHRUN_HOPPER_BWD_DQ", "FLASHRUN_PDL",
                   "FLASHRUN_DECODE_GLUON")

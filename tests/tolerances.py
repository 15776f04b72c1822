"""Float32 tolerances that depend on the backend the tests run on.

A TPU evaluates float32 exp, log and log1p with its own approximations: on a v5e (2026-12-05,
benchmarks/tpu_run.sh) the losses' golden values (log-sigmoid, logsumexp) came out up to 1.5e-4
relative from their float64 references (Bradley-Terry 3.6e-5, Davidson 1.5e-4), where the CPU
is within 1e-6. Matmuls are not the cause: the losses have none, and float32 models run their
matmuls at "highest" precision (`rewardax.models.kernels`).
"""

import jax

ON_TPU = jax.default_backend() == "tpu"

# float32 values through exp/log against float64 references (relative).
F32_RTOL = 3e-4 if ON_TPU else 1e-6
# Gradients against central differences: the approximation error of the functions above divided
# by the step moves the numeric side too.
NUMERIC_GRAD_ATOL = 2e-4 if ON_TPU else 1e-5
# Absolute, for float32 results that should cancel to zero through exp/log: the v5e left 1.3e-6
# in the Gaussian NLL's gradient at its optimum (2026-12-06), where the CPU is within 1e-6.
F32_ATOL = 1e-5 if ON_TPU else 1e-6

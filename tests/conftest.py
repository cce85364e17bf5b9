"""Test-session settings that must precede every import of Triton.

Without a GPU, Triton's kernels run in its interpreter (``TRITON_INTERPRET=1``). Triton reads the
variable when ``triton.jit`` wraps a function, and its own library functions (``tl.max``, ``tl.sum``,
...) are wrapped when ``triton`` is first imported, which torchtitan or any kernel module may do
during collection. A kernel interpreted later that calls a library function wrapped for compilation
fails ("Cannot call @triton.jit'd outside of the scope of a kernel"), so the variable is set here,
before any test module is imported. With a GPU the kernels are compiled and tested on it.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

"""trtllm_mtp_carry: carry the MTP drafter's KV rows from one turn of a chat
session to the next on hybrid (SSM + attention) models served by TensorRT-LLM.

Importing the package loads only the pure-Python carry core (no torch, no GPU
library), so schedulers and serving front-ends can use it cheaply. The data
plane (`trtllm_mtp_carry.dataplane`), the reference engine
(`trtllm_mtp_carry.engine`), the runtime and the adapters import torch and are
loaded only when imported by name.
"""

from .core import *  # noqa: F403  (the core's __all__ is the package's API)
from .core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = [*_core_all, "__version__"]

"""recover: resilient LLM pre-training that keeps the training trajectory through replica failures.

Every committed step processes exactly the same M microbatches as a failure-free run and
normalises the gradient by M. See README.md and the module docstrings of each layer:
``recover.comm`` (fault-tolerant collectives), ``recover.recovery`` (in-step recovery) and
``recover.workload`` (workload policy).
"""

__version__ = "0.1.0"

_API = {"init": "recover.api", "Job": "recover.api", "Runtime": "recover.api"}
_PACKAGES = {"data": "recover.data"}  # what a script reaches as recover.data.tokens(...) after `import recover`


def __getattr__(name: str) -> object:
    """``recover.init`` and ``recover.Job`` (:mod:`recover.api`), and ``recover.data``, imported on first use:
    ``recover --help`` and the launcher stay free of torch."""
    import importlib

    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    if name in _PACKAGES:
        return importlib.import_module(_PACKAGES[name])
    raise AttributeError(f"module 'recover' has no attribute {name!r}")

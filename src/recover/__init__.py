"""recover: resilient LLM pre-training that keeps the training trajectory through replica failures.

Every committed step processes exactly the same M microbatches as a failure-free run and
normalises the gradient by M. See README.md and the module docstrings of each layer:
``recover.comm`` (fault-tolerant collectives), ``recover.recovery`` (in-step recovery) and
``recover.workload`` (workload policy).
"""

__version__ = "0.1.0"

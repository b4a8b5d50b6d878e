"""The built-in architecture, Llama, in one folder: everything recover knows about it.

- :mod:`~recover.model.llama.model`: the modules (RMSNorm, rotary attention, SwiGLU), read top to bottom;
- :mod:`~recover.model.llama.tp`: its tensor-parallel plan;
- :mod:`~recover.model.llama.hf`: its Hugging Face ``LlamaForCausalLM`` mapping;
- :mod:`~recover.model.llama.spec`: the :class:`~recover.model.spec.ModelSpec` that ties them together
  (pipeline split, layout rules, FLOPs) and that ``model.arch = "llama"`` selects.

A second built-in architecture is a sibling folder of the same shape plus its line in
:mod:`recover.model.spec`'s table of built-ins; one defined elsewhere is added with
:func:`recover.model.spec.register`. This package imports nothing on its own (the registry imports
``spec``, which imports no torch).
"""

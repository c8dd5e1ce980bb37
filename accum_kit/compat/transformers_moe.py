"""transformers' mixture-of-experts internals (transformers 5.24).

Mixtral, Qwen2-MoE and OLMoE dispatch their fused experts through ``transformers.integrations.moe``'s
``ExpertsInterface``, chosen by the private config attribute ``_experts_implementation``. Its default on CPU
is ``grouped_mm`` (``torch._grouped_mm``), which takes float32, bfloat16 and float16 only: a float64 copy
of the model (verify's oracle) raises "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got
Double". ``"eager"`` (a loop over the experts) runs in any dtype and computes the same function.
"""

from __future__ import annotations


def eager_experts(model) -> None:
    """Make every config of ``model`` that names an experts implementation use ``"eager"`` (in place)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"

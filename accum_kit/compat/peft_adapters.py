"""peft's and transformers' marks of an adapted model, read in one place.

``is_adapted`` is asked by the train job (``--use_peft`` on a model that already carries adapters) and by the
mesh engine (tensor parallel refuses adapted models), so it sits here rather than in either. It touches
transformers' ``_hf_peft_config_loaded`` (set by ``PreTrainedModel.load_adapter``; transformers 5.24) and peft's
``BaseTunerLayer`` (peft 0.21.2).
"""

from __future__ import annotations


def is_adapted(model) -> bool:
    """Whether ``model`` carries peft adapters already: a ``PeftModel``, a transformers model loaded with an
    adapter (``_hf_peft_config_loaded``), or any peft tuner layer inside it. False without peft installed."""
    if getattr(model, "_hf_peft_config_loaded", False):
        return True
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(model, PeftModel) or any(isinstance(m, BaseTunerLayer) for m in model.modules())

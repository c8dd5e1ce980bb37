"""LoRA adapters (``peft``) in the train job: TRL's flags, the model wrapped once, the adapter saved as peft does.

``--use_peft`` freezes the model and trains low-rank adapters on some of its linear layers
(Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685) through
``peft.get_peft_model``. The flags are TRL's (``trl.ModelConfig``, what ``trl sft --use_peft`` reads),
with its defaults: ``--lora_r 16``, ``--lora_alpha 32``, ``--lora_dropout 0.05``, and
``--lora_target_modules`` unset meaning peft's own choice for the model type (GPT-2: ``c_attn``;
Llama and Mixtral: ``q_proj``, ``v_proj``). ``--lora_target_modules all-linear`` is peft's "every
linear layer but the output layer".

Nothing else in the toolkit changes for a ``PeftModel``: the loop, the engines and the memory model
count what ``requires_grad`` says is trained (docs/adapters.md). Quantised base weights (QLoRA's
``--load_in_4bit`` / ``--load_in_8bit``) are refused.

The module imports neither torch nor peft at import time (the flag checks run before either is needed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import checks
from ..compat.peft_adapters import is_adapted
from ..errors import UsageError

#: TRL's defaults (``trl.ModelConfig``) for the flags left unset with ``--use_peft``.
TRL_DEFAULTS = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05}
#: The flags that mean something only with ``--use_peft``.
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
#: The peft release the exactness tests ran with (pyproject.toml's ``peft`` extra pins it).
PEFT_TESTED = "0.21.2"
INSTALL_FIX = "pip install 'accum-kit[peft]' (peft==" + PEFT_TESTED + ", the version tested)"


@dataclass(frozen=True)
class LoraSettings:
    """One run's LoRA settings (the flags resolved).

    Attributes:
        r: the adapters' rank; alpha: the scaling numerator (the update is ``alpha / r B A x``);
        dropout: the dropout probability on the adapters' input; target_modules: module names (matched as
        peft matches them: the whole name or its last dotted parts), ``("all-linear",)``, or None for
        peft's default for the model type.
    """

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules) if self.target_modules is not None else None
        return d


def resolve_lora_flags(cfg) -> LoraSettings | None:
    """The LoRA settings of a :class:`accum_kit.job.config.TrainConfig` (or any object with its fields), checked;
    None without ``--use_peft``. Unset flags take :data:`TRL_DEFAULTS`.

    Raises:
        UsageError: ``--load_in_4bit`` / ``--load_in_8bit`` (quantised base weights are not supported); a
            ``--lora_*`` flag without ``--use_peft``; ``--lora_r`` below 1; ``--lora_alpha`` not above 0;
            ``--lora_dropout`` outside [0, 1); an empty target name.
    """
    for name in ("load_in_4bit", "load_in_8bit"):
        if getattr(cfg, name, False):
            raise UsageError(f"--{name}", "quantised base weights (QLoRA, bitsandbytes) are not supported: the "
                             "exactness checks and the memory model assume weights in the compute precision",
                             "drop it: --use_peft trains LoRA adapters on a float32 (or --mixed_precision bf16) model")
    if not getattr(cfg, "use_peft", False):
        given = [f for f in LORA_FLAGS if getattr(cfg, f, None) is not None]
        if given:
            raise UsageError(f"--{given[0]}", "is a LoRA setting, but --use_peft is not given",
                             "add --use_peft to train adapters, or drop the --lora_* flags")
        return None
    r = cfg.lora_r if cfg.lora_r is not None else TRL_DEFAULTS["lora_r"]
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else TRL_DEFAULTS["lora_alpha"]
    dropout = cfg.lora_dropout if cfg.lora_dropout is not None else TRL_DEFAULTS["lora_dropout"]
    checks.at_least("--lora_r", r, fix="pass a rank of 1 or more, e.g. --lora_r 8")
    checks.positive("--lora_alpha", alpha, fix="pass e.g. --lora_alpha 16 (the update is scaled by alpha / r)")
    checks.non_negative("--lora_dropout", dropout, fix="pass a probability in [0, 1), e.g. 0.05 or 0")
    if dropout >= 1:
        raise UsageError("--lora_dropout", f"must be below 1 (got {dropout})", "pass a probability in [0, 1)")
    targets = cfg.lora_target_modules
    if targets is not None:
        targets = tuple(str(t) for t in ([targets] if isinstance(targets, str) else targets))
        if not targets or any(not t.strip() for t in targets):
            raise UsageError("--lora_target_modules", f"names no module (got {list(targets)!r})",
                             "pass module names such as c_attn or q_proj v_proj, or all-linear, or omit the flag")
    alpha = int(alpha) if float(alpha).is_integer() else float(alpha)  # TRL's and peft's alpha is an int
    return LoraSettings(int(r), alpha, float(dropout), targets)


def require_peft(flag: str = "--use_peft"):
    """The ``peft`` module.

    Raises:
        UsageError (``flag``): peft is not installed.
    """
    try:
        import peft
    except ImportError:
        raise UsageError(flag, "needs the peft package, which is not installed", INSTALL_FIX) from None
    return peft


def adaptable_modules(model) -> list[str]:
    """The last names of ``model``'s modules LoRA can wrap (``torch.nn.Linear``, transformers' ``Conv1D``), sorted,
    each once (e.g. GPT-2: ``c_attn``, ``c_fc``, ``c_proj``, ``lm_head``)."""
    import torch

    kinds = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D

        kinds += (Conv1D,)
    except ImportError:
        pass
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and isinstance(m, kinds)})


def _matches(target: str, names: list[str]) -> bool:
    """peft's rule (``check_target_module_exists``): the whole module name, or its last dotted parts."""
    return any(n == target or n.endswith("." + target) for n in names)


def default_targets(model) -> list[str] | None:
    """peft's default LoRA targets for the model's ``config.model_type`` (None: peft has none)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found = DEFAULTS.get(model_type)
    return list(found) if found else None


def apply_lora(model, settings: LoraSettings, *, source: str = "the model"):
    """``peft.get_peft_model(model, LoraConfig(...))``: every weight of ``model`` frozen, adapters on the targets.

    Args:
        model: a transformers causal LM (float32 or bfloat16 weights), not yet prepared.
        settings: :func:`resolve_lora_flags`' result.
        source: how messages name the model (its path or preset).

    Returns:
        The ``peft.PeftModelForCausalLM`` (``model`` is changed in place inside it).

    Raises:
        UsageError: peft not installed (``--use_peft``); ``model`` already carries an adapter (``--use_peft``);
            a target naming no module of the model, or no default target for its type (``--lora_target_modules``,
            listing the modules LoRA can wrap).
    """
    peft = require_peft()
    if is_adapted(model):
        raise UsageError("--use_peft", f"{source} already carries a peft adapter, and a second one would be "
                         "trained on top of it", "resume the adapter run with --resume_from_checkpoint, or merge it "
                         "into the weights first (PeftModel.merge_and_unload(), then save_pretrained) and load that")
    names = [n for n, _ in model.named_modules() if n]
    linear = adaptable_modules(model)
    targets = settings.target_modules
    if targets is None:
        targets = default_targets(model)
        if targets is None:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise UsageError("--lora_target_modules", f"peft has no default LoRA targets for model type {model_type!r}",
                             f"name them, e.g. --lora_target_modules {' '.join(linear[:2]) or 'all-linear'} (the "
                             f"modules LoRA can wrap here: {', '.join(linear)})")
    elif targets != ("all-linear",):
        missing = [t for t in targets if not _matches(t, names)]
        if missing:
            raise UsageError("--lora_target_modules", f"{', '.join(missing)} names no module of {source}",
                             f"pass some of the modules LoRA can wrap here: {', '.join(linear)} (or all-linear)")
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules="all-linear" if tuple(targets) == ("all-linear",) else list(targets),
                             bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def adapter_record(model) -> dict | None:
    """What a summary and a checkpoint say of ``model``'s adapter, or None for a model without one.

    Returns:
        ``{"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules" (as peft resolved them, sorted),
        "trainable_parameters", "frozen_parameters" (elements), "peft_version"}``.
    """
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    config = getattr(inner, "peft_config", None)
    if not isinstance(config, dict) or not config:
        return None
    import peft

    c = next(iter(config.values()))
    targets = c.target_modules
    trainable = sum(p.numel() for p in inner.parameters() if p.requires_grad)
    total = sum(p.numel() for p in inner.parameters())
    return {"peft_type": str(getattr(c.peft_type, "value", c.peft_type)), "r": getattr(c, "r", None),
            "lora_alpha": getattr(c, "lora_alpha", None), "lora_dropout": getattr(c, "lora_dropout", None),
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
            "trainable_parameters": trainable, "frozen_parameters": total - trainable, "peft_version": peft.__version__}


#: What a resumed run must share with the checkpoint's adapter: (record key, the flag that sets it).
RESUME_KEYS = (("r", "--lora_r"), ("lora_alpha", "--lora_alpha"), ("target_modules", "--lora_target_modules"))


def check_adapter_resume(path, saved: dict | None, now: dict | None) -> None:
    """Refuse a resume whose adapter differs from the one the checkpoint at ``path`` holds.

    Args:
        path: the checkpoint folder (for the message).
        saved: the checkpoint's :func:`adapter_record` (its loop state's ``adapter``; None: full fine-tuning).
        now: this run's record (None: full fine-tuning).

    Raises:
        UsageError: one trains adapters and the other does not (``--use_peft``), or the rank, alpha or targets
            differ (that flag): the saved weights would not load, or would mean another update.
    """
    if saved is None and now is None:
        return
    if (saved is None) != (now is None):
        had = "LoRA adapters" if saved is not None else "every weight (full fine-tuning)"
        fix = "add --use_peft with the checkpoint's --lora_* settings" if saved is not None else "drop --use_peft"
        raise UsageError("--use_peft", f"{path} was saved by a run that trained {had}, but this run "
                         f"{'does not' if saved is not None else 'trains LoRA adapters'}", fix)
    for key, flag in RESUME_KEYS:
        if saved.get(key) != now.get(key):
            value = saved.get(key)
            shown = " ".join(value) if isinstance(value, list) else value
            raise UsageError(flag, f"{path} holds adapters with {key} {saved.get(key)} but this run has "
                             f"{now.get(key)}, so its weights would not load (or would mean another update)",
                             f"resume with {flag} {shown}")

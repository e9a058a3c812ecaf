"""A Hugging Face model as its config describes it, built on the meta device (no memory, no
weights), and the param groups vanilla Trainer builds for it: what both the import and the
export of Trainer's ``optimizer.pt`` (matched by position) must agree on."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from llmtailor.errors import ConfigError, IncompatibleModelError
from llmtailor.layouts import Layout


def trainer_param_groups(config: dict[str, Any], adapters: dict[str, Any] | None = None) -> list[list[str]]:
    """Parameter names of the two groups vanilla Trainer's ``create_optimizer`` builds for the
    model of ``config`` (decay, then no-decay; each in ``named_parameters`` order), under the
    canonical names; with ``adapters`` (peft configs), for that ``PeftModel``: its trainable
    parameters only. The model is built on the meta device: no memory, no weights."""
    import transformers

    model = meta_model(config)
    if adapters:
        import peft

        (first, settings), *others = adapters.items()
        with torch.device("meta"):
            model = peft.get_peft_model(model, peft.get_peft_config(settings), adapter_name=first)
            for name, more in others:
                model.add_adapter(name, peft.get_peft_config(more))
    # Trainer.get_decay_parameter_names does not use `self`; calling it keeps us on exactly the
    # rule of the installed transformers (layer types and name patterns).
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    canonical = (lambda n: n.removeprefix("base_model.model.")) if adapters else (lambda n: n)
    return [[canonical(n) for n, _ in named if n in decay], [canonical(n) for n, _ in named if n not in decay]]


def check_trainer_groups(config: dict[str, Any], layout: Layout, groups: list[dict[str, Any]],
                         adapters: dict[str, Any] | None = None) -> None:
    """Raise IncompatibleModelError naming the first parameter whose group or position differs
    between the run's optimizer and the one vanilla Trainer would build; optimizer.pt is
    matched by position, so anything else would load state onto the wrong parameters."""
    expected = trainer_param_groups(config, adapters)
    held = set(layout.tensor_names()) | set(layout.aliases)
    unknown = [n for names in expected for n in names if n not in held]
    if unknown:
        raise IncompatibleModelError(
            f"the run's model config builds parameters the run does not hold, e.g. {sorted(unknown)[:3]}"
        )
    saved = [list(g.get("params", [])) for g in groups]
    flat_saved = [(i, n) for i, names in enumerate(saved) for n in names]
    flat_expected = [(i, n) for i, names in enumerate(expected) for n in names]
    rule = (
        "vanilla Trainer builds 2 groups: weight decay for every trainable parameter except biases "
        "and norm weights, then the rest (Trainer.create_optimizer); a run must use those groups to "
        "export to HF"
    )
    for position, (have, want) in enumerate(zip(flat_saved, flat_expected)):
        if have != want:
            raise IncompatibleModelError(
                f"optimizer parameter {position}: the run has {have[1]!r} in group {have[0]}, "
                f"vanilla Trainer would put {want[1]!r} in group {want[0]} there; {rule}"
            )
    if len(flat_saved) != len(flat_expected) or len(saved) != len(expected):
        extra = flat_saved[len(flat_expected):] or flat_expected[len(flat_saved):]
        first = f"; first differing parameter: {extra[0][1]!r}" if extra else ""
        raise IncompatibleModelError(
            f"the run's optimizer has {len(saved)} group(s) of {[len(s) for s in saved]} parameters, "
            f"vanilla Trainer would build {len(expected)} of {[len(e) for e in expected]}{first}; {rule}"
        )


def meta_model(config: dict[str, Any]) -> torch.nn.Module:
    import transformers

    model_type = config.get("model_type")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConfigError(f"model config: unknown model_type {model_type!r} for this transformers") from None
    hf_config = config_class.from_dict(config)
    architectures = config.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"), _outside_zero3_init():
        if model_class is not None:
            return model_class._from_config(hf_config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def _outside_zero3_init() -> contextlib.AbstractContextManager[Any]:
    """While a ZeRO-3 ``TrainingArguments`` lives in this process, transformers builds every
    model under DeepSpeed's ``zero.Init``, whose collectives wait for the other ranks: a meta
    model (shapes only, built on one rank, e.g. by an import) must not be, so we say that
    ``zero.Init`` is entered already (transformers' own flag for nested builds)."""
    from transformers import modeling_utils

    return getattr(modeling_utils, "set_zero3_state", contextlib.nullcontext)()

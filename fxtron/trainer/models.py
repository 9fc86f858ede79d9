"""Trainer, models: the one resolver of a model spec -- a shipped preset, hf:<architecture>,
package.module:factory or a transformers directory (config.json, and its weights when it has
them) -- which `fxtron train --model` and `fxtron inspect` (tools/inspect.py) both read,
always built on the meta device (each rank makes only its shards); and how a batch of samples
(seq + 1 tokens each) becomes the model's inputs: (tokens, targets) for fxtron's models and a
factory's, input_ids with shift_labels for transformers' (so the loss predicts every next
token of the sample, as Megatron's labels = text[1:])."""
from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass

import torch

from fxtron.errors import ParallelizeError
from fxtron.trainer.config import DataConfig


@dataclass
class TrainModel:
    model: torch.nn.Module               # on the meta device
    transformers: bool                   # inputs as transformers' keywords
    vocab_size: int
    pretrained: str | None = None        # a directory whose weights to load
    data: DataConfig | None = None       # how samples pack documents (--reset-position-ids, ...)
    example: tuple | None = None         # a factory's example inputs (args, kwargs), when it returned them

    def inputs(self, tokens: torch.Tensor) -> tuple[tuple, dict]:
        """(args, kwargs) of a (B, seq + 1) batch of samples. With packed documents
        (Megatron's --reset-position-ids / --reset-attention-mask / --eod-mask-loss): the
        positions restarting after each end-of-document token, each token's document (fxtron's
        models keep attention inside it; transformers' build that mask from the positions), and
        no loss where the input is the end of a document."""
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        d = self.data
        if d is not None and d.eod_mask_loss:
            y = y.masked_fill(x == d.eod_id, -100)            # the losses' ignore_index
        extra = {}
        if d is not None and d.packed:
            from fxtron.data.gpt import position_and_document_ids
            position, document = position_and_document_ids(x, d.eod_id)
            if d.reset_position_ids:
                extra["position_ids"] = position
            if d.reset_attention_mask:
                extra["document_ids"] = document
        if self.transformers:
            if extra:
                extra = {"position_ids": extra["position_ids"], "use_cache": False}   # (the mask from the positions)
            return (), {"input_ids": x, "labels": x, "shift_labels": y, **extra}
        return (x, y), extra

    @staticmethod
    def counted(args: tuple, kwargs: dict) -> int:
        """The labels a token-mean loss counts in a batch `inputs` made (those not ignored, -100):
        the weight of its mean loss in a mean over several batches, as the loss over all of them
        would be computed (Megatron sums the losses and the tokens, and divides once)."""
        labels = kwargs.get("shift_labels", args[1] if len(args) > 1 else None)
        return int((labels != -100).sum())

    def loss_parts(self, model: torch.nn.Module, args: tuple, kwargs: dict, params: dict | None = None) -> tuple:
        """The loss of a batch `inputs` made as (its token-mean cross entropy, the rest): the rest
        is what the model adds to the mean (a mixture of experts' load-balancing loss), which
        gradient accumulation averages over microbatches where the mean is weighted by tokens
        (tools/reference.py's `parts`). The mean is the cross entropy of the model's logits
        over the counted labels: transformers' output's own; fxtron's and a factory's model
        called again without targets (where that returns no (.., vocab) logits, the whole loss is
        the mean). With `params`, computed with those tensors in place of the model's."""
        import torch.nn.functional as F

        def call(*a, **kw):
            return model(*a, **kw) if params is None else torch.func.functional_call(model, params, a, kw)
        if self.transformers:
            out = call(*args, **kwargs)
            loss, logits, labels = out.loss, out.logits, kwargs["shift_labels"]
        else:
            (x, labels), loss = args, call(*args, **kwargs)
            logits = call(x, **kwargs)
            if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != labels.shape:
                return loss, loss.new_zeros(())
        mean = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)
        return mean, loss - mean

    @property
    def documents(self) -> str | None:
        """The input of each token's document when the samples pack documents apart, positions
        restarting in each (Megatron's --reset-position-ids --reset-attention-mask) -- what
        context parallel balances document by document (cp_documents, THD); None otherwise
        (transformers' models take the positions alone and build the mask from them)."""
        d = self.data
        if d is None or self.transformers or not (d.reset_position_ids and d.reset_attention_mask):
            return None
        return "document_ids"

    def check_packing(self, spec: str) -> None:
        """Can the model take the packed documents asked for? (a ParallelizeError if not)"""
        d = self.data
        if d is None or not d.packed:
            return
        if self.transformers:
            if d.reset_position_ids != d.reset_attention_mask:
                raise ParallelizeError(
                    f"model {spec}: transformers' models build the document mask from positions that restart at each "
                    f"document, so --reset-position-ids and --reset-attention-mask go together for them")
            return
        wanted = [k for k, on in (("position_ids", d.reset_position_ids), ("document_ids", d.reset_attention_mask)) if on]
        params = inspect.signature(self.model.forward).parameters
        missing = [k for k in wanted if k not in params]
        if missing:
            raise ParallelizeError(f"model {spec}: packed documents pass {', '.join(missing)}= to its forward, which "
                                   f"takes no such argument ({type(self.model).__name__}.forward"
                                   f"{inspect.signature(self.model.forward)}); drop --reset-position-ids / "
                                   "--reset-attention-mask, or use a model that takes them (gpt-*, llama-*)")


def _has_weights(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def _vocab(model: torch.nn.Module) -> int | None:
    for holder in (model, getattr(model, "config", None)):
        v = getattr(holder, "vocab_size", None)
        if isinstance(v, int):
            return v
    emb = getattr(model, "get_input_embeddings", None)
    if callable(emb) and emb() is not None:
        return emb().num_embeddings
    return None


def key_values(pairs) -> dict:
    """KEY=VALUE strings as a dict, each value read as JSON where it is (4, 1e-5, true)."""
    import json
    out = {}
    for pair in pairs or ():
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ParallelizeError(f"--model-config takes KEY=VALUE pairs, not {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def resolve(spec: str, seed: int = 0, overrides: dict | None = None, data: DataConfig | None = None) -> TrainModel:
    """The model `spec` names, built on the meta device; `overrides` set fields of an
    hf:<architecture>'s config; `data`: how its samples pack documents."""
    tm = build_model(spec, seed, overrides)
    if tm.vocab_size is None:
        raise ParallelizeError(f"model {spec!r}: cannot tell its vocabulary size (give the model a vocab_size)")
    tm.data = data
    tm.check_packing(spec)
    return tm


def build_model(spec: str, seed: int = 0, overrides: dict | None = None) -> TrainModel:
    """The one resolver of a model spec (the trainer's `resolve`, inspect's `load_model`): a
    preset, hf:<architecture> (its default config with `overrides` set), a transformers
    directory (its config; its weights to load when it has them) or package.module:factory (its
    model, and its example inputs when it returns (model, args[, kwargs])), built on the meta
    device. The vocabulary size is None where the model does not tell it."""
    from fxtron import models
    if overrides and not spec.startswith("hf:"):
        raise ParallelizeError(f"--model-config ({', '.join(overrides)}) sets fields of an hf:<architecture>'s "
                               f"config; {spec!r} is not one: a model configuration is for hf:<architecture> models "
                               f"(a directory's config.json or a preset fixes its own)")
    if spec in models.PRESETS:
        model = models.build(spec, device="meta", seed=seed)
        return TrainModel(model, False, _vocab(model))
    if spec.startswith("hf:") or os.path.isdir(spec):
        try:
            import transformers
        except ImportError:
            raise ParallelizeError(f"model {spec}: transformers models need the transformers package") from None
        if os.path.isdir(spec):
            if not os.path.exists(os.path.join(spec, "config.json")):
                raise ParallelizeError(f"model directory {spec} has no config.json; give a transformers directory "
                                       "(save_pretrained), a preset, hf:<architecture> or package.module:factory")
            config = transformers.AutoConfig.from_pretrained(spec)
            pretrained = spec if _has_weights(spec) else None
        else:
            config = hf_config(spec[3:], overrides)
            pretrained = None
        cls = next((getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)), None)
        with torch.device("meta"):
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
        return TrainModel(model, True, int(config.vocab_size), pretrained)
    if os.sep in spec or spec.startswith(("~", ".")):
        raise ParallelizeError(f"model directory {spec} does not exist; give a transformers directory "
                               "(save_pretrained), a preset, hf:<architecture> or package.module:factory")
    if ":" in spec:
        factory = load_factory(spec)
        with torch.device("meta"):
            out = factory()
        model, example = out, None
        if isinstance(out, tuple):
            model = out[0]
            if len(out) > 1:
                example = (tuple(out[1]), dict(out[2]) if len(out) > 2 else {})
        return TrainModel(model, False, _vocab(model), example=example)
    raise ParallelizeError(f"unknown model {spec!r}: a preset ({', '.join(models.PRESETS)}), hf:<architecture> "
                           "(hf:llama), package.module:factory, or a directory with config.json")


def load_factory(spec: str):
    """The function `package.module:factory` names, or a ParallelizeError saying why not."""
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ParallelizeError(f"cannot load the model factory {spec!r}: {e}") from None


def hf_config(arch: str, overrides: dict | None = None):
    """transformers' default config of architecture `arch` with `overrides` set (each a field
    the config has, or a ParallelizeError naming the closest)."""
    try:
        import transformers
    except ImportError:
        raise ParallelizeError("hf: models need the transformers package (pip install transformers)") from None
    try:
        cfg = transformers.AutoConfig.for_model(arch)
    except ValueError:
        import difflib

        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        near = difflib.get_close_matches(arch, list(CONFIG_MAPPING.keys()), n=3)
        raise ParallelizeError(f"transformers {transformers.__version__} knows no architecture {arch!r}"
                               + (f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else "")
                               + "; hf:<architecture> takes a model_type of transformers' configs, such as 'llama', "
                               "'qwen2', 'mixtral'") from None
    known = set(cfg.to_dict())
    given = {}
    for key, value in (overrides or {}).items():
        if key not in known:
            import difflib
            near = difflib.get_close_matches(key, sorted(known), n=3)
            raise ParallelizeError(f"{type(cfg).__name__} has no field {key!r}"
                                   + (f" (did you mean {', '.join(map(repr, near))}?)" if near else ""))
        given[key] = typed(value, getattr(cfg, key), f"{type(cfg).__name__}.{key}")
    if not given:
        return cfg
    # built again from the fields given, as transformers builds a config: the fields its
    # constructor derives from them (Llama's head_dim from hidden_size, num_key_value_heads
    # from num_attention_heads) follow them -- set on the default config, they kept the default's
    try:
        return transformers.AutoConfig.for_model(arch, **given)
    except Exception as e:     # (transformers' validators raise their own classes)
        raise ParallelizeError(f"--model-config {', '.join(f'{k}={v}' for k, v in given.items())}: "
                               f"{type(cfg).__name__} refuses it: {' '.join(str(e).split())}") from None


def typed(value, like, name: str):
    """A --model-config value read as the type of the field's default `like` (bool, int,
    float, a list of them): 'False' for a bool, '4' for an int, '1,2' or '[1, 2]' for a list;
    a ParallelizeError naming the field where it cannot be."""
    if like is None or not isinstance(value, str) and (not isinstance(like, (list, tuple)) or
                                                       isinstance(value, (list, tuple))):
        if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value
    text = str(value).strip()
    try:
        if isinstance(like, bool):
            word = text.lower()
            if word in ("true", "1", "yes", "on"):
                return True
            if word in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
        if isinstance(like, (list, tuple)):
            import json
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                items = [x.strip() for x in text.strip("[]()").split(",") if x.strip()]
            if not isinstance(items, list):
                items = [items]
            if like:
                items = [typed(x, like[0], name) if isinstance(x, str) else x for x in items]
            return type(like)(items)
    except ValueError:
        kind = type(like).__name__
        a = "an" if kind[0] in "aeiou" else "a"
        raise ParallelizeError(f"--model-config {name}={text}: the field is {a} {kind} "
                               f"(its default is {like!r}); give {a} {kind}") from None
    return value


__all__ = ["TrainModel", "build_model", "hf_config", "key_values", "load_factory", "resolve", "typed"]

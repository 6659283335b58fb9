"""Settings checked for their kind of value before anything is built from them: a word given for a number or
for true/false (`trainer.max_epochs=abc`, `model.gamma=abc`, `backbone.agt_depth=abc`, `eval.tile=maybe`)
otherwise reaches the code, which fails deep inside (Lightning's `fit` with a bare assertion, a comparison of
str and int) with a traceback, or reads any word as true. The trainer, loggers, callbacks, data and the
LightningModule are checked against their classes' `__init__` (`check_setting_types`; for Lightning's, the
annotations of the installed version, so the check follows its signature as it changes), the optimiser and LR
schedule partials against torch's classes when the module builds them (`instantiate_partial`), the backbone
knobs against `BackboneConfig`'s fields (`typed_values`), and the settings of nodes built from no class (eval.*,
infer.*, bench.*, runtime.*, seed) against the kind of their shipped values (`check_against_shipped`; one name
where a list is shipped is that list of one). Where an annotation names a class a config value cannot be (an
Accelerator, a timedelta), it judges nothing; a tensor, which no config value is, is never fitted."""

from __future__ import annotations

import inspect
import logging
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import torch

if TYPE_CHECKING:
    from omegaconf import DictConfig

PLAIN_KINDS = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "a string",
    type(None): "null",
}
SEQUENCE_ORIGINS = (list, tuple, Iterable, Sequence)


def whole_number(value: Any, setting: str) -> int:
    """A setting that counts (steps, pairs) as an int: Hydra reads `trainer.max_steps=1e5` as the float 100000.0,
    which counts 100000; anything else that is not a whole number (`10k`, `2.5`, `true`) is a ValueError naming
    `setting`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{setting}={value!r}: expected a whole number")


def count_at_least(value: Any, setting: str, least: int) -> int:
    """`whole_number`, refused naming `setting` below `least` (steps, repeats, nodes: 0 would divide by zero or do
    nothing after the work before it)."""
    count = whole_number(value, setting)
    if count < least:
        raise ValueError(f"{setting}={value}: expected a whole number >= {least}")
    return count


def annotated_types(target: type) -> dict[str, Any]:
    """The annotation of each parameter `target(...)` takes: its own `__init__`'s, then, for the parameters it
    passes on through `**kwargs`, its base classes'."""
    hints: dict[str, Any] = {}
    for cls in inspect.getmro(target):
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        own = resolved_annotations(init)
        parameters = inspect.signature(init).parameters
        for name in parameters:
            if name in own and name not in hints:
                hints[name] = own[name]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            break
    hints.pop("return", None)
    return hints


def resolved_annotations(function: Any) -> dict[str, Any]:
    """`function`'s parameter annotations as types, each resolved on its own: one that names a type imported
    only for type checkers (WandbLogger's `Artifact`) is left out, and the others still count."""
    try:
        return typing.get_type_hints(function)
    except (NameError, AttributeError, TypeError):
        pass
    namespace = vars(sys.modules[function.__module__])
    resolved = {}
    for name, annotation in function.__annotations__.items():
        try:
            # as typing.get_type_hints evaluates each, in the namespace of the function's module
            resolved[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except (NameError, AttributeError, TypeError, SyntaxError):
            continue
    return resolved


def fits(value: Any, hint: Any) -> bool:
    """Whether the config value (None, bool, number, string, list, mapping) can be `hint`; True for a hint
    it cannot judge (a class other than the plain ones and Path) and for a node Hydra builds (`_target_`)."""
    if isinstance(value, Mapping) and "_target_" in value:
        return True
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint in (str, Path):
        return isinstance(value, str)
    if hint is type(None):
        return value is None
    if origin in SEQUENCE_ORIGINS:
        sequence = isinstance(value, Sequence) and not isinstance(value, str)  # a list, a tuple, a ListConfig
        return sequence and (not args or all(fits(item, args[0]) for item in value))
    if origin in (dict, Mapping):
        return isinstance(value, Mapping) and (not args or all(fits(item, args[1]) for item in value.values()))
    # torch's optimisers take `lr: float | Tensor`: a config value is the number, never the tensor
    return hint is not torch.Tensor


def described(hint: Any) -> str:
    """`hint` in the words of a config file: `Optional[int]` is "a whole number or null"."""
    words = list(dict.fromkeys(kinds(hint)))
    if "a number" in words and "a whole number" in words:
        words.remove("a whole number")
    if len(words) > 1 and "a tensor" in words:
        words.remove("a tensor")
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]


def kinds(hint: Any) -> list[str]:
    """Each kind of value `hint` takes, in a config file's words: the members of a Union, the values of a
    Literal."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return [word for arg in args for word in kinds(arg)]
    if origin is Literal:
        return [repr(arg) for arg in args]
    if hint in PLAIN_KINDS:
        return [PLAIN_KINDS[hint]]
    if hint is Path:
        return ["a path"]
    if hint is torch.Tensor:
        return ["a tensor"]
    if origin in SEQUENCE_ORIGINS:
        return [f"a list (each {described(args[0])})" if args else "a list"]
    if origin in (dict, Mapping):
        return ["a mapping"]
    return [getattr(hint, "__name__", str(hint))]


def typed_values(
    values: Mapping[str, Any], hints: Mapping[str, Any], setting: str, target: str
) -> dict[str, Any]:
    """The values (plain: None, bool, number, string, list, dict) of the settings `<setting>.<key>` that
    `target` takes, checked against its annotations `hints`. Two of a wrong type are what the command meant and
    are returned as that (the dict of those changed): a whole number Hydra read as a float (`1e3`) where only a
    whole number fits, and a number where only a string fits (`logger.wandb.project=2026`). Anything else is one
    ValueError listing every such `<setting>.<key>=<value>` with what `target` takes."""
    meant, refused = {}, []
    for key, value in values.items():
        if key not in hints or fits(value, hints[key]):
            continue
        if isinstance(value, float) and value.is_integer() and fits(int(value), hints[key]):
            meant[key] = whole_number(value, f"{setting}.{key}")
        elif isinstance(value, int | float) and not isinstance(value, bool) and fits(str(value), hints[key]):
            meant[key] = str(value)
        else:
            refused.append(f"{setting}.{key}={value!r} ({target} takes {described(hints[key])})")
    refuse(refused)
    return meant


def check_setting_types(node: DictConfig, setting: str, given_elsewhere: Iterable[str] = ()) -> None:
    """`typed_values` of the config `node` (cfg.<setting>, whose `_target_` is the class built from it), with
    what the command meant written back into `node`. Keys in `given_elsewhere` (passed to the class by the code)
    and Hydra's own (`_target_`) are not read. (Hydra and OmegaConf are imported here, so that the network's
    module, which checks its knobs with `typed_values`, does not import them.)"""
    from omegaconf import OmegaConf

    values = {
        key: OmegaConf.to_container(node[key], resolve=True) if OmegaConf.is_config(node[key]) else node[key]
        for key in node
        if not key.startswith("_") and key not in given_elsewhere and not OmegaConf.is_missing(node, key)
    }
    hints = annotated_types(target_class(node._target_, setting))
    for key, value in typed_values(values, hints, setting, node._target_).items():
        node[key] = value


def target_class(target: str, setting: str) -> type:
    """The class `<setting>._target_` names (a dotted path); one that cannot be imported, or is no class, is a
    ValueError naming the setting, for Hydra's error would be a traceback (after Hydra's own log of it, which is
    left out)."""
    import hydra

    hydra_log = logging.getLogger("hydra.utils")
    disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        return hydra.utils.get_class(target)
    except (ImportError, ValueError) as error:
        reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise ValueError(
            f"{setting}._target_={target} is not a class that can be imported ({reason}): set it to the dotted "
            "path of a class, as the shipped configs do"
        ) from None
    finally:
        hydra_log.disabled = disabled


def instantiate_partial(config: Mapping[str, Any], name: str, **overrides: Any) -> Callable[..., Any]:
    """The callable a Hydra partial config (`_partial_: true`) describes, with `overrides` bound too. Its settings
    are checked against the target's annotations first (`typed_values`: `model.optimizer.lr=abc` is one
    ValueError naming `<name>.lr` and what it takes). A call its target refuses with a TypeError or ValueError
    (torch's "Invalid learning rate: -1", a keyword it does not take) is a ValueError naming `name`, the target
    and its reason."""
    if not config.get("_partial_"):
        raise ValueError(
            f"{name} must be a Hydra partial (`_partial_: true`): the module passes the parameters "
            f"(optimizer) or the optimiser (scheduler) itself; got {dict(config)}"
        )
    import hydra

    target = target_class(config["_target_"], name)
    settings = {key: value for key, value in {**config, **overrides}.items() if not key.startswith("_")}
    meant = typed_values(settings, annotated_types(target), name, config["_target_"])
    build = partial(hydra.utils.instantiate(config, **overrides), **meant)

    def call(*args: Any) -> Any:
        try:
            return build(*args)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name} ({config['_target_']}) refuses its settings: {error}") from error

    return call


def in_plain_node(cfg: DictConfig, key: str) -> bool:
    """Whether no node above `key` (`eval.tile`, `trainer.max_steps`) is built from a `_target_`, whose class
    `check_setting_types` checks."""
    from omegaconf import OmegaConf

    parts = key.split(".")
    return not any(OmegaConf.select(cfg, ".".join([*parts[:end], "_target_"])) for end in range(len(parts)))


def check_against_shipped(overridden: Iterable[str], cfg: DictConfig, shipped: DictConfig) -> dict[str, Any]:
    """Each setting the command set (`overridden`: keys such as `eval.tile`, each `in_plain_node`) checked against
    its shipped value (`shipped`: the config the command's config choices compose to, without its settings).
    Where that is true/false or a number, a word (`eval.tile=maybe`, which Python would read as true;
    `infer.video_fps=abc`) is one ValueError listing each such setting with its shipped value. Where it is a
    list, one plain value is what the command meant as the list's one item (`eval.sets=synthetic`, which would
    be read letter by letter): returned as {key: [value]}. Other shipped values (strings, null) judge nothing."""
    from omegaconf import OmegaConf

    meant, refused = {}, []
    for key in overridden:
        default = OmegaConf.select(shipped, key, throw_on_resolution_failure=False)
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        if OmegaConf.is_list(default) and isinstance(value, str | int | float):  # bool is an int
            meant[key] = [value]
            continue
        if isinstance(default, bool):
            wanted, kind = bool, PLAIN_KINDS[bool]
        elif isinstance(default, int | float):
            wanted, kind = float, PLAIN_KINDS[float]
        else:
            continue
        if not fits(value, wanted):
            shown = str(default).lower() if isinstance(default, bool) else default  # as a config file writes it
            refused.append(f"{key}={value!r} (takes {kind}, as its shipped value {shown})")
    refuse(refused)
    return meant


def refuse(refused: list[str]) -> None:
    """One ValueError for every setting of the wrong kind (each `<key>=<value> (takes ...)`), if any."""
    if refused:
        raise ValueError(f"{'; '.join(refused)}: set {'them' if len(refused) > 1 else 'it'} to such a value")

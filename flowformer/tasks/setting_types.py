"""A config node's values checked against the types its `_target_` annotates, before the object is built: a word
given for a number (`trainer.max_epochs=abc`, `trainer.benchmark=maybe`) otherwise reaches Lightning, which
fails deep inside `fit` (an assertion, a comparison of str and int) or at once with a traceback. The check
reads the annotations of the installed version, so it follows Lightning's signature as it changes; where an
annotation names a class a config value cannot be (an Accelerator, a timedelta), it judges nothing."""

from __future__ import annotations

import collections.abc
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import hydra
from omegaconf import DictConfig, OmegaConf

from flowformer.overrides import whole_number

PLAIN_KINDS = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "a string",
    type(None): "null",
}
SEQUENCE_ORIGINS = (list, tuple, collections.abc.Iterable, collections.abc.Sequence)


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
            resolved[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except (NameError, AttributeError, TypeError, SyntaxError):
            continue
    return resolved


def fits(value: Any, hint: Any) -> bool:
    """Whether the plain config value (None, bool, number, string, list, dict) can be `hint`; True for a hint
    it cannot judge (a class other than the plain ones and Path) and for a node Hydra builds (`_target_`)."""
    if isinstance(value, dict) and "_target_" in value:
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
        return isinstance(value, list) and all(fits(item, args[0]) for item in value) if args else True
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict) and (not args or all(fits(v, args[1]) for v in value.values()))
    return True


def described(hint: Any) -> str:
    """`hint` in the words of a config file: `Optional[int]` is "a whole number or null"."""
    words = list(dict.fromkeys(kinds(hint)))
    if "a number" in words and "a whole number" in words:
        words.remove("a whole number")
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
    if origin in SEQUENCE_ORIGINS:
        return [f"a list (each {described(args[0])})" if args else "a list"]
    if origin in (dict, collections.abc.Mapping):
        return ["a mapping"]
    return [getattr(hint, "__name__", str(hint))]


def check_setting_types(
    node: DictConfig, setting: str, given_elsewhere: collections.abc.Iterable[str] = ()
) -> None:
    """Each value of `node` (cfg.<setting>, whose `_target_` is the class built from it) that its parameter's
    annotation refuses. Two are what the command meant and are set so in `node`: a whole number Hydra read as a
    float (`1e3`) where only a whole number fits, and a number where only a string fits (`logger.wandb.project=
    2026`). Anything else is one ValueError listing every such `<setting>.<key>=<value>` with what it takes.
    Keys in `given_elsewhere` (passed to the class by the code) and Hydra's own (`_target_`) are not read."""
    hints = annotated_types(hydra.utils.get_class(node._target_))
    refused = []
    for key in node:
        if (
            key.startswith("_")
            or key in given_elsewhere
            or key not in hints
            or OmegaConf.is_missing(node, key)
        ):
            continue
        value = (
            OmegaConf.to_container(node[key], resolve=True) if OmegaConf.is_config(node[key]) else node[key]
        )
        if fits(value, hints[key]):
            continue
        if isinstance(value, float) and value.is_integer() and fits(int(value), hints[key]):
            node[key] = whole_number(value, f"{setting}.{key}")
            continue
        if isinstance(value, int | float) and not isinstance(value, bool) and fits(str(value), hints[key]):
            node[key] = str(value)
            continue
        refused.append(f"{setting}.{key}={value!r} ({node._target_} takes {described(hints[key])})")
    if refused:
        raise ValueError(f"{'; '.join(refused)}: set {'them' if len(refused) > 1 else 'it'} to such a value")

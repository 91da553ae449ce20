"""Configuration: packaged defaults <- user YAML file <- ``--set key.path=value`` overrides.

OmegaConf does the merging and parses override values as YAML (so ``--set
train.epochs=5`` is an int and ``--set data.image_size=[320,160]`` a list); pydantic
validates the result. Defaults live only in ``configs/default.yaml``; the schema here says
what each value must be.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput


class ConfigError(BadInput):
    """The configuration is invalid; the message names the key."""


class KeysDisagree(ValueError):
    """Values that are each valid but not together (raised by a check across sections); ``key``
    is the one the message is about."""

    def __init__(self, key: str, problem: str):
        super().__init__(problem)
        self.key = key


class _Section(BaseModel):
    # frozen: a validated config is never changed in place; config_with() makes a changed copy;
    # no NaN or infinity in any number (a NaN compares false with everything; JSON has neither)
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True, allow_inf_nan=False)


def _finite_numbers(value, where: str = ""):
    """``value`` (a plugin's params) if every number in it is finite: the run's config.yaml and
    checkpoint store it as JSON, where NaN and infinity do not exist (they became null)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise BadInput(f"{where or 'a value'} is {value}; plugin parameters must be finite numbers")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite_numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for number, item in enumerate(value):
            _finite_numbers(item, f"{where}[{number}]")
    return value


Params = Annotated[dict[str, Any], AfterValidator(_finite_numbers)]  # extra keyword arguments for a plugin


def _not_a_boolean(value):
    if isinstance(value, bool):
        raise BadInput(f"a number, got the boolean {str(value).lower()}")
    return value


# whole numbers and switches are taken only as such: "3" (quoted), true or 3.5 for a count, or 1 for a
# switch, is an error, not silently 3, 1, 3 or true; numbers may be written as whole numbers
Int = Annotated[int, Strict()]
PositiveInt = Annotated[int, Strict(), Field(gt=0)]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]


# sizes far beyond any receipt model: a checkpoint naming one is corrupt or crafted, and would make
# index or search allocate without end
MAX_SIDE = 2048
MAX_WIDTH = 65536
MIN_SIDE = 16  # smaller inputs vanish in the encoders' strided layers (and mean nothing on a receipt)
Side = Annotated[int, Strict(), Field(ge=MIN_SIDE, le=MAX_SIDE)]
Width = Annotated[int, Strict(), Field(gt=0, le=MAX_WIDTH)]
# captures are decoded and cached at train.cache_margin x data.image_size; the cache is held to the
# same side limit as the model input (a margin of 2000 decoded 24 GB per capture)
MAX_CACHE_MARGIN = 4


def cache_size(image_size: tuple[int, int], margin: float = 1.25) -> tuple[int, int]:
    """Cached resolution (``train.cache_margin`` x ``data.image_size``): a margin above the model
    input so crops keep detail."""
    height, width = image_size
    return round(height * margin), round(width * margin)


class DataConfig(_Section):
    image_size: tuple[Side, Side]
    grayscale: Bool
    # a default here too: checkpoints written before the key existed must still load
    page_crop: Bool = False


class IngestConfig(_Section):
    split_ratios: tuple[Float, Float, Float]
    seed: Int
    max_pixels: PositiveInt
    # a default here too: checkpoints written before the key existed must still load
    max_bytes: PositiveInt = 64 * 1024 * 1024
    allow_absolute_paths: Bool
    merge_duplicates: Bool

    @field_validator("split_ratios")
    @classmethod
    def _ratios(cls, value):
        if any(r < 0 for r in value) or abs(sum(value) - 1.0) > 1e-6:
            raise BadInput(f"must be three non-negative numbers summing to 1, got {list(value)}")
        return value


class ModelConfig(_Section):
    encoder: str
    pretrained: str | None
    pooling: Literal["gap", "grid"]
    grid: tuple[Annotated[int, Strict(), Field(gt=0, le=64)], Annotated[int, Strict(), Field(gt=0, le=64)]]
    head_hidden: Width
    head_dim: Width
    bn_momentum: Float = Field(gt=0, le=1)
    input_norm: Literal["fixed", "per_image"]
    whiten: Bool = False  # a checkpoint written before the key existed loads without whitening, as it was trained
    params: Params = Field(default_factory=dict)  # extra keyword arguments for the encoder plugin


# far above any softmax temperature that trains (0.05 to 1); at 1e300 every logit is 0 in float32
# and the loss is NaN
MAX_TEMPERATURE = 100


class LossConfig(_Section):
    name: str
    temperature: Float = Field(gt=0, le=MAX_TEMPERATURE)
    koleo_weight: Float = Field(default=0.0, ge=0, allow_inf_nan=False)
    params: Params


class AugmentConfig(_Section):
    preset: str
    params: Params


class SamplerConfig(_Section):
    name: str
    params: Params


class TrainConfig(_Section):
    epochs: int | str  # a positive number, or "auto" (training.schedule.planned_epochs)
    max_minutes: Float | None = Field(default=None, gt=0, allow_inf_nan=False)
    batch_size: PositiveInt
    seed: Int = Field(ge=0, lt=2**63)  # what numpy's and torch's seeding take
    lr: Float = Field(gt=0)
    weight_decay: Float = Field(ge=0)
    warmup_epochs: Float = Field(ge=0)
    grad_clip: Float = Field(ge=0)
    precision: Literal["auto", "fp32", "bf16"]
    num_workers: Int = Field(ge=0, le=64)  # worker processes; more is a fork bomb, not a speed-up
    deterministic: Bool
    cache_margin: Float = Field(ge=1, le=MAX_CACHE_MARGIN)
    eval_batch_size: PositiveInt
    bn_recalibrate: Int = Field(ge=0)
    select_on: Literal["backbone", "head"]
    momentum: Float = Field(ge=0, le=1)

    @field_validator("epochs", mode="before")
    @classmethod
    def _epochs(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise BadInput(f"a positive whole number of epochs, or auto, got {shortened(repr(value), 60)}")


class PluginsConfig(_Section):
    dir: str | None  # null: ./plugins on the command line, no folder for library calls
    strict: Bool

    @field_validator("dir")
    @classmethod
    def _dir_named(cls, value):
        if value == "":  # a path of "" is the current directory: every *.py there would be imported
            raise BadInput(
                "an empty folder name, which reads as the current directory; name the plugins folder, or leave "
                "plugins.dir out (null) for ./plugins"
            )
        return value


class Config(_Section):
    data: DataConfig
    ingest: IngestConfig
    model: ModelConfig
    loss: LossConfig
    augment: AugmentConfig
    sampler: SamplerConfig
    train: TrainConfig
    plugins: PluginsConfig

    @model_validator(mode="after")
    def _cache_within_limits(self):
        cached = cache_size(tuple(self.data.image_size), self.train.cache_margin)
        if max(cached) > MAX_SIDE:
            raise KeysDisagree(
                "train.cache_margin",
                f"{self.train.cache_margin:g} x data.image_size {list(self.data.image_size)} caches images of "
                f"{cached[0]} x {cached[1]}, over {MAX_SIDE} a side; use a smaller train.cache_margin or data.image_size",
            )
        return self


# a config is a page of YAML; anything far larger is not one
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 20_000  # YAML events (keys, values, brackets) in one config file
DEFAULT_CONFIG = files("receipt_embed") / "configs" / "default.yaml"
DEMO_CONFIG = files("receipt_embed") / "configs" / "demo.yaml"


def _schema_fields(model: type[BaseModel], path: Sequence[str]) -> list[str]:
    for key in path:
        annotation = model.model_fields[key].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _explain(error: dict) -> str:
    loc = [shortened(part) for part in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        siblings = _schema_fields(Config, loc[:-1])
        close = difflib.get_close_matches(loc[-1], siblings, n=1)
        prefix = ".".join(loc[:-1])
        hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
        if not close and not prefix:  # a section's key without its section: `max_minutes` for `train.max_minutes`
            owners = [section for section in siblings if loc[-1] in _schema_fields(Config, [section])]
            hint = f"; did you mean '{owners[0]}.{loc[-1]}'?" if len(owners) == 1 else hint
        valid = ", ".join(siblings)
        return f"unknown config key '{key}'{hint} (valid keys here: {valid})"
    if error["type"] == "missing":
        return f"missing config key '{key}'"
    if error["type"] == "value_error":
        problem = error["ctx"]["error"]
        if isinstance(problem, KeysDisagree):  # a check across sections: its key is not the location
            key = problem.key
        return f"config key '{key}': {shortened(str(problem))}"
    return f"config key '{key}': {error['msg']} (got {shortened(repr(error.get('input')))})"


def _refuse_aliases(text: str, path: Path | None, where: str | None = None, depth: int = 0) -> None:
    """A config never needs YAML aliases, and a few nested ones ("billion laughs") expand into
    more nodes than memory holds once OmegaConf copies the shared references; refuse any. The
    parse is event by event, so a value nested 40,000 deep is refused, not a RecursionError.
    ``where`` names the text when it is not a file (an override); ``depth`` is how deep the
    text sits already (the levels of an override's key path)."""
    nodes = 0

    def at(event) -> str:
        return where or f"config file {path}, line {event.start_mark.line + 1}"

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        nodes += 1
        if nodes > MAX_CONFIG_NODES:  # the config library copies each node several times: a long list crawls
            raise ConfigError(f"{at(event)}: more than {MAX_CONFIG_NODES} values; a config never needs that many")
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(
                f"{at(event)}: YAML aliases (*{event.anchor}) are not allowed in a config; write the values out"
            )
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:  # deep nesting makes the YAML and config libraries crawl, then crash
                raise ConfigError(
                    f"{at(event)}: nested more than {MAX_CONFIG_DEPTH} levels deep; a config never needs that"
                )
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9_]*)\Z")
# a number YAML 1.1 (the YAML library) reads as text, or a float where a whole number is written: an
# exponent (1e8, 1.0e8 are text, 1.0e+8 a float) or a sign before the point (-.5 is text)
# digits grouped in threes (1_000_000) before any point or exponent; YAML 1.1 drops every other _ too
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(_\d{3})+([.eE][^_]*)?\Z")
_EXPONENT_OR_SIGNED_POINT = re.compile(r"[-+]?(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+\Z|[-+]\.\d[\d_]*\Z")
_NUMBER_TAG = "tag:receipt-embed,2026:number"
_LEADING_ZERO = re.compile(r"[-+]?0[\d_]*[89][\d_]*\Z")  # 09: YAML 1.1 reads it as text (not octal, not decimal)


def _written_number(text: str) -> int | float:
    """The number ``text`` (1e8, 2.5e3, 1.5e0, -.5) writes: a whole one in exponent form (under
    2**63) as an int, so that counts such as ingest.max_pixels take 1e8, else a float; infinity
    (1e400) beyond a float's range."""
    digits = text.replace("_", "")
    number = float(digits)
    if not math.isfinite(number) or "e" not in digits.lower():
        return number  # without an exponent (-.5, -.0) a float, as 3.0 is
    try:
        exact = Decimal(digits)  # the digits as written: 1.0000000000000000001e0 is no whole number
    except InvalidOperation:  # an exponent of 19 digits or more (the number reads as 0.0)
        return number
    whole = exact == exact.to_integral_value() and abs(exact) < 2**63  # a larger count is no count, 1e300 a float
    return int(exact) if whole else number


class _ConfigLoader(yaml.SafeLoader):
    """The safe YAML loader, reading numbers in exponent form as numbers (YAML 1.1 reads 1e8 as the
    text '1e8', which a count refused as "quoted"); whole ones (1e8, 2.5e3) as ints."""

    def resolve(self, kind, value, implicit):
        if kind is yaml.ScalarNode and implicit[0] and _EXPONENT_OR_SIGNED_POINT.match(value):
            return _NUMBER_TAG
        return super().resolve(kind, value, implicit)


_ConfigLoader.add_constructor(_NUMBER_TAG, lambda loader, node: _written_number(node.value))


_NUMERIC_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", _NUMBER_TAG)


def _unclear_number(node) -> str | None:
    """Why a plain YAML scalar reads as another number than the digits written, or None: YAML 1.1
    reads ``017`` as octal 15, ``0x1e`` as 30, ``1:30`` (base 60) as 90, ``09`` as text, and
    ``1e400`` would be infinity."""
    if not isinstance(node, yaml.ScalarNode) or node.style:
        return None
    written_out = node.tag == "tag:yaml.org,2002:float" and not node.value.lstrip("+-").startswith(".")  # not .inf
    if (node.tag == _NUMBER_TAG and not math.isfinite(_written_number(node.value))) or (
        written_out and ":" not in node.value and not math.isfinite(float(node.value.replace("_", "")))
    ):
        return (
            f"{shortened(node.value)} is beyond the largest number a config holds (about 1.8e308) and would read "
            "as infinity; write a smaller number"
        )
    if node.tag == "tag:yaml.org,2002:str" and _LEADING_ZERO.match(node.value):
        return (
            f"{shortened(node.value)} reads as text in YAML (a leading zero); write the number without it, or "
            "quote it if it is text"
        )
    base_60 = ":" in node.value
    if node.tag == "tag:yaml.org,2002:int" and (base_60 or not _DECIMAL.match(node.value)):
        kind = "base 60" if base_60 else "octal, hexadecimal or binary"
    elif node.tag == "tag:yaml.org,2002:float" and base_60:
        kind = "base 60"
    elif node.tag in _NUMERIC_TAGS and "_" in node.value and not _THOUSANDS.match(node.value):
        number = _written_number(node.value) if node.tag == _NUMBER_TAG else yaml.safe_load(node.value)
        return (
            f"{shortened(node.value)} reads as {number} in YAML (it drops a _ between any characters); write the "
            "number without _, or with _ only between groups of three digits (1_000_000), or quote it if it is text"
        )
    else:
        return None
    return (
        f"{shortened(node.value)} reads as {yaml.safe_load(node.value)} in YAML ({kind}); write the number in "
        "plain decimal digits (no leading zero), or quote it if it is text"
    )


def _scalars(node) -> list:
    """The scalar value nodes under ``node`` (a composed YAML tree without aliases), in written order."""
    found, pending = [], [node]
    while pending:
        item = pending.pop()
        if isinstance(item, yaml.MappingNode):
            pending.extend(value for _, value in item.value)
        elif isinstance(item, yaml.SequenceNode):
            pending.extend(item.value)
        elif isinstance(item, yaml.ScalarNode):
            found.append(item)
    return sorted(found, key=lambda item: item.start_mark.index)


def _unclear_numbers(node) -> list:
    """The scalar nodes under ``node`` (a composed YAML tree without aliases) that :func:`_unclear_number` refuses."""
    return [item for item in _scalars(node) if _unclear_number(item)]


def _numbers_written_out(item: str, value) -> str:
    """``item`` (``key.path=value``, its value composed as ``value``) with each number in exponent
    form written out as :class:`_ConfigLoader` reads it (1e8 as 100000000): the config library's
    YAML reads 1e8 as the float 100000000.0, which a count refuses."""
    start = len(item.split("=", 1)[0]) + 1
    for node in reversed([node for node in _scalars(value) if node.tag == _NUMBER_TAG]):
        written = repr(_written_number(node.value))
        item = item[: start + node.start_mark.index] + written + item[start + node.end_mark.index :]
    return item


def _refuse_repeated_keys(text: str, path: Path) -> None:
    """A key given twice in one mapping (a second ``train:`` section further down, say) would
    silently replace the first, and all the settings under it; refuse it, naming both lines.
    Called after :func:`_refuse_aliases`, so the node graph is small and has no shared parts."""
    root = yaml.compose(text, Loader=_ConfigLoader)
    for node in _unclear_numbers(root)[:1]:
        raise ConfigError(f"config file {path}, line {node.start_mark.line + 1}: {_unclear_number(node)}")
    pending = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    line = key.start_mark.line + 1
                    if key.tag == "tag:yaml.org,2002:merge" and not key.style:
                        raise ConfigError(
                            f"config file {path}, line {line}: key '<<' is YAML's merge key (it copies the keys of "
                            "another mapping in); a config writes its keys out: give them one by one"
                        )
                    if key.tag != "tag:yaml.org,2002:str" and not key.style:  # YAML reads `on`, `~`, `0` as no name
                        raise ConfigError(
                            f"config file {path}, line {line}: key {shortened(key.value)!r} is not a name (YAML reads "
                            "it as a number, a boolean or null); config keys are names: quote it if it is one, and "
                            "give a list such as data.image_size whole ([96, 48])"
                        )
                    if key.value in first_line:
                        raise ConfigError(
                            f"config file {path}, line {line}: key {shortened(key.value)!r} is given twice in one "
                            f"mapping (first on line {first_line[key.value]}); the second would replace the first "
                            "and everything under it: merge them"
                        )
                    first_line[key.value] = line
                pending.append(value)
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)


def _load_yaml(path: Path) -> dict:
    """A YAML mapping from a regular file (a FIFO or device named by --config is refused, not read)."""
    from receipt_embed.userfiles import UnusableFile, read_regular_text

    try:
        text = read_regular_text(path, MAX_CONFIG_BYTES)
        _refuse_aliases(text, path)
        _refuse_repeated_keys(text, path)
        data = yaml.load(text, Loader=_ConfigLoader)
    except ConfigError:
        raise
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise ConfigError(f"config file not found: {path}") from None
        raise ConfigError(f"config file {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason})") from None
    except yaml.YAMLError as exc:  # one line: the problem and where (the rest of the message quotes the file)
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML: {problem}{where}") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ConfigError(f"config file {path}: a value cannot be read ({str(exc).split(';')[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    _refuse_other_types(data, path)
    return data


_PLAIN_TYPES = (str, int, float, bool, type(None), list, dict)


def _refuse_other_types(data: dict, path: Path) -> None:
    """YAML reads ``2001-12-14`` as a date, ``!!set {a}`` as a set and ``!!binary`` as bytes, which
    the config library cannot hold: named by key here instead of failing inside it."""
    pending = [("", data)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, dict):
            pending += [(f"{where}.{key}" if where else str(key), item) for key, item in value.items()]
        elif isinstance(value, list):
            pending += [(f"{where}[{i}]", item) for i, item in enumerate(value)]
        elif not isinstance(value, _PLAIN_TYPES):
            raise ConfigError(
                f"config file {path}: key {quoted(shortened(where, 200))} holds a YAML {type(value).__name__} "
                f"({shortened(str(value), 80)}), which a config does not take; quote it if it is text"
            )


MAX_OVERRIDE_NODES = 9_000  # values, keys and brackets in one --set value


def _node_count(node) -> int:
    """The nodes of a composed YAML value: each scalar, each key, each list or mapping."""
    count, pending = 0, [node]
    while pending:
        item = pending.pop()
        count += 1
        if isinstance(item, yaml.MappingNode):
            for key, value in item.value:
                pending += [key, value]
        elif isinstance(item, yaml.SequenceNode):
            pending.extend(item.value)
    return count


def _has_merge_key(node) -> bool:
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, yaml.MappingNode):
            if any(key.tag == "tag:yaml.org,2002:merge" and not key.style for key, _ in item.value):
                return True
            pending.extend(value for _, value in item.value)
        elif isinstance(item, yaml.SequenceNode):
            pending.extend(item.value)
    return False


def _drops_a_comment(text: str) -> bool:
    """Whether YAML reads part of an override's value as a comment (`` #`` and after), which a
    config file may have but a ``--set`` value written on one line almost never means. A comment
    is whatever holds a ``#`` between two of YAML's tokens (a ``#`` inside a value is in a token);
    a tab reads as a space here, as the config library's own parser reads ``3<TAB>#x``."""
    spaced = text.replace("\t", " ")
    try:
        tokens = list(yaml.scan(spaced, Loader=_ConfigLoader))
    except yaml.YAMLError:  # not YAML: the config library's own parser says what is wrong
        return False
    return any("#" in spaced[a.end_mark.index : b.start_mark.index] for a, b in zip(tokens, tokens[1:]))


def key_levels(key: str) -> int:
    """How many levels ``key.path`` (or ``list[0]``) nests its value, as a config file would."""
    return key.count(".") + key.count("[") + 1


def _parse_overrides(overrides: Sequence[str], flag: str = "--set") -> list:
    """One config layer per ``key.path=value``; ``flag`` is the option that gave them, for messages."""
    layers = []
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"{flag} expects key.path=value, got '{shortened(item)}'")
        where = f"{flag} '{shortened(item)}'"
        levels = key_levels(item.split("=", 1)[0])
        if levels > MAX_CONFIG_DEPTH:  # the config library nests a key path by recursion: 5000 parts crash it
            raise ConfigError(
                f"{where}: the key path is nested more than {MAX_CONFIG_DEPTH} levels deep; a config never needs that"
            )
        try:
            _refuse_aliases(item.split("=", 1)[1], None, where, depth=levels)
            value = yaml.compose(item.split("=", 1)[1], Loader=_ConfigLoader)
        except yaml.YAMLError:  # the config library's own parser says what is wrong below
            value = None
        for node in _unclear_numbers(value)[:1] if value is not None else ():
            raise ConfigError(f"{where}: {_unclear_number(node)}")
        if value is not None and _node_count(value) > MAX_OVERRIDE_NODES:  # the config library's own limit is 10,000
            raise ConfigError(
                f"{where}: the value has {_node_count(value):,} items and keys; a --set value may have at most "
                f"{MAX_OVERRIDE_NODES:,}: put a list this long in a config file (--config)"
            )
        if value is not None and _has_merge_key(value):
            raise ConfigError(f"{where}: '<<' is YAML's merge key; a config writes its keys out: give them one by one")
        if _drops_a_comment(item.split("=", 1)[1]):
            raise ConfigError(
                f"{where}: YAML reads the text from its '#' on as a comment and would drop it; quote the value "
                "if the # belongs to it, or leave the comment out"
            )
        try:
            layers.append(OmegaConf.from_dotlist([_numbers_written_out(item, value)]))
        except RecursionError:  # ${oc.decode:[[[...]]]}: the interpolation's grammar recurses per bracket
            raise ConfigError(f"cannot parse {where}: {_TOO_DEEP}") from None
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
            first_line = str(exc).strip().splitlines()[0]
            raise ConfigError(f"cannot parse {where}: {shortened(first_line)}") from None
    return layers


_TOO_DEEP = f"an interpolation nests too deeply to read (a config nests at most {MAX_CONFIG_DEPTH} levels)"


def _source_of(key: str, layers: list, sources: Sequence[str]) -> str | None:
    """Which layer (the defaults, a config file, an override) last gives ``key`` (dotted), if any."""
    for layer, source in reversed(list(zip(layers, sources))):
        node = OmegaConf.to_container(layer, resolve=False)
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            return source
    return None


_MISSING = object()


def _container_clash(layers: list, sources: Sequence[str]) -> str | None:
    """Why the layers cannot be merged, naming the layer and the key: a list given where the layers
    below hold a mapping (``augment: {params: [1, 2]}``) or a mapping where they hold a list. The
    config library says only "Cannot merge incompatible container types"."""
    if len(sources) != len(layers):
        return None
    below = OmegaConf.to_container(layers[0], resolve=False)
    for layer, source in zip(layers[1:], sources[1:]):
        given = OmegaConf.to_container(layer, resolve=False)
        pending = [("", below, given)]
        while pending:
            prefix, old, new = pending.pop()
            for key, value in new.items() if isinstance(new, dict) and isinstance(old, dict) else ():
                path = f"{prefix}.{key}" if prefix else str(key)
                if isinstance(old.get(key), dict) and isinstance(value, list):
                    return f"{source}: {shortened(path)} must be a mapping, got a list"
                if isinstance(old.get(key), list) and isinstance(value, dict):
                    return (
                        f"{source}: {shortened(path)} must be a list, got a mapping; a list such as data.image_size "
                        'is given whole (--set "data.image_size=[96,48]"), never one element'
                    )
                pending.append((path, old.get(key), value))
        try:
            below = OmegaConf.to_container(OmegaConf.merge(below, given), resolve=False)
        except (OmegaConfBaseException, TypeError):
            return None
    return None


def _given_value(key: str, layers: list):
    """The value of ``key`` (dotted; a list element by its index) as the last layer giving it wrote
    it, interpolations unresolved; ``_MISSING`` if none gives it."""
    for layer in reversed(layers):
        node = OmegaConf.to_container(layer, resolve=False)
        for part in key.split("."):
            if isinstance(node, dict):
                node = node.get(part, _MISSING)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                node = _MISSING
        if node is not _MISSING:
            return node
    return _MISSING


_NUMBER_OR_SWITCH = re.compile(r"\s*([-+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?|true|false|True|False)\s*\Z")
_TYPE_ERRORS = {"int_type", "bool_type", "value_error"}  # the strict types (and train.epochs) refuse text


def _text_not_a_number(error: dict, layers: list) -> str:
    """Why a number or switch given as text (a quoted ``"3"``, or ``${oc.env:NAME,3}``, whose
    default the config library gives as the text '3') is refused, with the fix; or ""."""
    given = error.get("input")
    if error["type"] not in _TYPE_ERRORS or not isinstance(given, str) or not _NUMBER_OR_SWITCH.match(given):
        return ""
    kind = "boolean" if given.strip().lower() in ("true", "false") else "number"
    raw = _given_value(".".join(str(part) for part in error["loc"]), layers)
    if isinstance(raw, str) and "${" in raw:
        return (
            f"; the value is the text {shortened(repr(given))} (interpolations such as oc.env give text), not a "
            f"{kind}: write ${{oc.decode:{shortened(raw)}}} to read it as one, or an unquoted {kind}"
        )
    return f"; the value is the text {shortened(repr(given))} (it is quoted), not a {kind}: write it unquoted"


def _validate(layers: list, sources: Sequence[str] = ()) -> Config:
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True)
    except OmegaConfBaseException as exc:
        problem = shortened(str(exc).strip().splitlines()[0])
        key = getattr(exc, "full_key", None)
        if key:  # an interpolation that names a missing key or variable: say whose value it is
            source = _source_of(key, layers, sources) if len(sources) == len(layers) else None
            raise ConfigError(
                f"config key '{key}'{f' (from {source})' if source else ''} cannot be resolved: {problem}"
            ) from None
        raise ConfigError(f"cannot resolve the config: {problem}") from None
    except RecursionError:  # an interpolation deeper than Python recurses
        raise ConfigError(f"cannot resolve the config: {_TOO_DEEP}") from None
    except TypeError as exc:  # a list where a mapping is expected, or `--set data.image_size[0]=32`
        clash = _container_clash(layers, sources)
        if clash:
            raise ConfigError(clash) from None
        raise ConfigError(
            f"cannot merge the config: {shortened(str(exc).strip().splitlines()[0])}; a list such as "
            'data.image_size is given whole (--set "data.image_size=[96,48]"), never one element'
        ) from None
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        explained = []
        for error in exc.errors():
            field = _list_field_of_wrong_length(error)
            if field:
                key = ".".join(field)
                line = _wrong_length(key, merged)
            else:
                line = _explain(error) + _text_not_a_number(error, layers)
                key = ".".join(str(part) for part in error["loc"])
            source = _source_of(key, layers, sources) if len(sources) == len(layers) else None
            if source and source.startswith("config file"):  # which file to fix (a --set names itself)
                line = line.replace(
                    f"config key '{shortened(key)}'", f"config key '{shortened(key)}' (from {source})", 1
                )
            if line not in explained:  # [] is missing both of image_size's numbers: said once
                explained.append(line)
        raise ConfigError("; ".join(explained)) from None


# what each value of a fixed-length list setting is, for the message when one has too few or too many
_LIST_MEANINGS = {
    "data.image_size": "height, width",
    "ingest.split_ratios": "train, val, heldout",
    "model.grid": "rows, columns",
}
_COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _list_field_of_wrong_length(error: dict) -> tuple[str, ...] | None:
    """The key path of a fixed-length list setting (``data.image_size``) when ``error`` says it has
    too few items, too many or is no list; None for any other error. Pydantic names a missing item
    by its index (``data.image_size.1``), which reads as a key the user should add."""
    loc = error["loc"]
    if error["type"] == "missing" and loc and isinstance(loc[-1], int):
        loc = loc[:-1]
    elif error["type"] not in ("too_long", "tuple_type"):
        return None
    model = Config
    for part in loc[:-1]:
        annotation = model.model_fields.get(part).annotation if isinstance(part, str) else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    field = model.model_fields.get(loc[-1]) if loc and isinstance(loc[-1], str) else None
    if field is None or typing.get_origin(field.annotation) is not tuple:
        return None
    return tuple(loc)


def _wrong_length(key: str, merged) -> str:
    """``config key 'data.image_size': two numbers (height, width), got [64]``."""
    model, value = Config, merged
    for part in key.split("."):
        model = model.model_fields[part].annotation
        value = value.get(part) if isinstance(value, dict) else None
    count = len(typing.get_args(model))
    meaning = f" ({_LIST_MEANINGS[key]})" if key in _LIST_MEANINGS else ""
    return f"config key '{key}': {_COUNT_WORDS.get(count, count)} numbers{meaning}, got {shortened(repr(value))}"


def _params_follow_the_encoder(layers: list) -> None:
    """``model.params`` are keyword arguments of ``model.encoder``: where a layer picks another
    encoder, the first layer's params (the packaged defaults' ``stem`` of receipt_cnn, or a loaded
    config's) are dropped, so another encoder starts from its own defaults instead of failing on
    arguments it does not take; params the layers above give still apply. The first layer's
    ``model.pretrained: bundled`` (receipt_cnn weights) goes with them, to ``none``."""
    base = OmegaConf.to_container(layers[0], resolve=False)
    model = base.get("model") if isinstance(base, dict) else None
    if not isinstance(model, dict):
        return
    pretrained = model.get("pretrained")  # "bundled" as receipt_embed.models.bundled.is_bundled reads it
    bundled = isinstance(pretrained, str) and pretrained.strip().lower() == "bundled"
    if not model.get("params") and not bundled:
        return
    if _given_value("model.encoder", layers[1:]) is _MISSING:
        return
    try:  # the encoder chosen, interpolations resolved; a config that cannot be merged is _validate's to say
        chosen = OmegaConf.select(OmegaConf.merge(*layers), "model.encoder")
    except (OmegaConfBaseException, RecursionError, TypeError):
        return
    if chosen == model.get("encoder"):
        return
    layers[0] = OmegaConf.merge(layers[0], {})  # a copy: the caller's layer is left as it was
    layers[0].model.params = {}
    if bundled:
        layers[0].model.pretrained = "none"


def config_with(
    config: Config, overrides: Sequence[str] = (), values: dict | None = None, flag: str = "--set"
) -> Config:
    """A validated copy of ``config`` with ``key.path=value`` overrides (parsed as ``--set``
    parses them; ``flag`` names the option that gave them in messages) and then ``values`` (a
    nested dict taken as it is, e.g. a path) applied."""
    layers = [OmegaConf.create(config.model_dump(mode="json")), *_parse_overrides(overrides, flag)]
    sources = ["the config", *(f"{flag} '{shortened(item)}'" for item in overrides)]
    if values:
        layers.append(OmegaConf.create(values))
        sources.append("the command")
    _params_follow_the_encoder(layers)
    return _validate(layers, sources)


def load_config(config_file: str | Path | Sequence[str | Path] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Merge defaults, optional user file(s) (later ones win) and ``key.path=value``
    overrides; validate."""
    layers = [OmegaConf.create(_load_yaml(Path(str(DEFAULT_CONFIG))))]
    sources = ["the packaged defaults"]
    files = [] if config_file is None else [config_file] if isinstance(config_file, (str, Path)) else list(config_file)
    for path in files:
        try:
            layers.append(OmegaConf.create(_load_yaml(Path(path))))
        except RecursionError:  # ${oc.decode:[[[...]]]}: the interpolation's grammar recurses per bracket
            raise ConfigError(f"config file {path}: {_TOO_DEEP}") from None
        sources.append(f"config file {path}")
    layers.extend(_parse_overrides(overrides))
    sources.extend(f"--set '{shortened(item)}'" for item in overrides)
    _params_follow_the_encoder(layers)
    return _validate(layers, sources)


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config next to a run's outputs (atomically)."""
    from receipt_embed.fileio import atomic_write_text

    atomic_write_text(path, config_to_yaml(config))

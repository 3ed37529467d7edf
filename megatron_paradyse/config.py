"""The paradyse config: one YAML file, validated into frozen dataclasses with errors that name the key.

Sections: ``planner`` (:class:`~megatron_paradyse.planner.PlannerConfig`), ``memory``, ``cost``,
``data`` and ``log``, plus ``megatron_args``: Megatron command-line flags a preset carries (the model,
the parallel layout); flags given on the command line win. ``docs/configs.md`` documents every key;
``paradyse check-config FILE --print-config`` shows the resolved config.

Loading reports every problem at once: unknown keys (with the nearest known name), wrong types,
values out of range, strategy names the library does not have. Paths are resolved relative to the
config file (``~`` is the user's home). Validation never touches a device.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_paradyse.attention import kernel_names
from megatron_paradyse.planner import PlannerConfig

__all__ = [
    "ConfigError",
    "CostSection",
    "DataSection",
    "LogSection",
    "MemorySection",
    "ParadyseConfig",
    "load_config",
    "section_keys",
]


class ConfigError(ValueError):
    """A paradyse config that cannot be used; the message lists every problem, one per line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySection:
    budget_gib: float | None = None
    """Per-rank memory budget for plans. None: what the CUDA caching allocator can hold times
    ``1 - margin`` (CUDA only; required on CPU)."""
    margin: float = 0.03
    """Fraction of what the caching allocator can hold kept out of the budget. What it can hold is the
    device's memory less what is in use outside it, measured at start-up (the CUDA context, cuBLAS and
    cuDNN, NCCL's communicators, which the entry point first connects for every group its steps use;
    the least over the ranks that plan together); the margin keeps room for the allocator's
    fragmentation (expandable segments: 1.002x to 1.03x of what it allocated on an H200) and for what
    starts outside it later (kernels loaded on first use; in the drop-in spec, the communicators of
    groups other than the tensor-parallel one). Planned without a device (``paradyse plan --gpu``), a
    node's assumed figure stands for the measurement
    (:attr:`~megatron_paradyse.cost.hardware.NodeSpec.outside_allocator_bytes`)."""
    oom_shrink: float = 0.1
    """After an out-of-memory error the budget shrinks by this fraction (how far the memory model
    under-predicted is unknown); every rank stops, and a relaunch with ``--load`` plans under the smaller
    budget, kept in ``paradyse_state.json`` in the ``--save`` directory."""
    oom_retries: int = 3
    """How many times one iteration may run out of memory and be re-run under a smaller budget; one more
    failure stops the run with a message."""
    preflight: bool | Literal["auto"] = "auto"
    """Before the first optimizer step, run forward and backward of the micro-batches the data will put at
    the highest predicted peak, measure their peaks and shrink the budget by what they exceed their
    predictions by (:mod:`~megatron_paradyse.run.preflight`). ``auto``: on a GPU, not on the CPU (where the
    memory tracker measures it, slowly)."""

    def __post_init__(self) -> None:
        if self.budget_gib is not None and not 0 < self.budget_gib < math.inf:
            raise ValueError(f"memory.budget_gib must be a finite number > 0, got {self.budget_gib}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"memory.margin must be in [0, 1), got {self.margin}")
        if not 0.0 < self.oom_shrink < 1.0:
            raise ValueError(f"memory.oom_shrink must be in (0, 1), got {self.oom_shrink}")
        if self.oom_retries < 0:
            raise ValueError(f"memory.oom_retries must be >= 0, got {self.oom_retries}")
        if self.preflight != "auto" and not isinstance(self.preflight, bool):
            raise ValueError(f"memory.preflight must be auto, true or false; got {self.preflight!r}")

    def budget_bytes(self, allocator_bytes: float | None) -> float | None:
        """The per-rank budget plans are made to: ``budget_gib``, else what the caching allocator can hold
        (``allocator_bytes``, None where there is no device to size it by) less ``margin``; None where
        neither is given."""
        if self.budget_gib is not None:
            return self.budget_gib * 2**30
        return None if allocator_bytes is None else allocator_bytes * (1.0 - self.margin)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostSection:
    profile: str | None = None
    """Calibration profile written by ``paradyse calibrate`` (relative to the config file). None: the
    run calibrates a quick profile at start-up and says so."""
    check_machine: bool = True
    """Refuse a profile calibrated on another machine or library version."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    dataset: str = "code"
    """``code`` (the interpreter's standard library, byte-level), ``dna`` (synthetic GRCh38-like, 3-mer
    tokens), or the prefix of a Megatron indexed dataset (``prefix.bin``/``prefix.idx``)."""
    cache_dir: str = "data"
    """Where the built-in corpora are built (relative to the config file)."""
    max_len: int = 4096
    """Longest sample in tokens; longer documents are split (or truncated, see ``overflow``)."""
    num_documents: int | None = None
    """Train on this many documents only, of ``min_len`` to ``max_len`` tokens, spread evenly in log length
    over that range (quick runs, the demo). None: every document."""
    min_len: int = 2
    """Shortest document ``num_documents`` may pick."""
    overflow: Literal["split", "truncate"] = "split"
    token_budget: int | None = None
    """None: one document per micro-batch. Otherwise documents are packed up to this many tokens."""
    sampler: Literal["curriculum", "bucketed", "random"] = "curriculum"
    """``curriculum``: short to long, as the paper; ``bucketed``: shuffled within length buckets."""
    bucket_size: int = 256
    seed: int = 1234
    """Seed of the data order (the ``bucketed`` and ``random`` shuffles); >= 0."""
    dna_sequences: int = 1000
    """Sequences of the built-in DNA corpus."""

    def __post_init__(self) -> None:
        for name in ("max_len", "bucket_size", "dna_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:  # numpy's generators take non-negative seeds only
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.num_documents is not None and self.num_documents < 1:
            raise ValueError(f"data.num_documents must be >= 1, got {self.num_documents}")
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError(f"data.min_len must be in [2, data.max_len={self.max_len}], got {self.min_len}")
        if self.token_budget is not None and self.token_budget < self.max_len:
            raise ValueError(f"data.token_budget={self.token_budget} must be at least data.max_len={self.max_len}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogSection:
    plot: str | None = None
    """Write a PNG of lengths and chosen plans over the run here (relative to the config file)."""
    jsonl: str | None = None
    """Append one JSON record per iteration here (relative to the config file): the table's content,
    for tools (``paradyse demo`` reads it)."""
    measure: bool = False
    """Measure each micro-batch's forward + backward time and peak memory beside the predictions (CUDA
    events and the allocator's peak, whose reset synchronises the device once per micro-batch; on the
    CPU a dispatch mode that watches every operator, whose own cost a quick profile calibrated at start-up
    takes into its correction: the times predicted are the metered job's). Under pipeline parallelism
    time only (a micro-batch's forward and backward through every model chunk of the stage), since a
    stage runs other micro-batches between one's forward and its backward. Off: the run makes no host
    synchronisation of its own inside a step, and the measured columns stay empty."""


_Word = typing.NewType("_Word", str)
"""One word of a command line (a flag or its value)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParadyseConfig:
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    memory: MemorySection = dataclasses.field(default_factory=MemorySection)
    cost: CostSection = dataclasses.field(default_factory=CostSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    attention_kernel: str = "auto"
    """``torch`` (CPU), ``flash_attn`` (CUDA), ``math`` (anywhere, O(s^2) memory) or ``auto``."""
    attention_mask: Literal["causal", "bidirectional"] = "causal"
    """``causal`` (GPT, LLaMA; zigzag canonical order) or ``bidirectional`` (BERT-style encoders;
    contiguous order): the layers' mask, the data layout and the attention cost terms follow it."""
    megatron_args: tuple[_Word, ...] = ()
    """Megatron flags of a preset, e.g. ``["--num-layers", "24", ...]``; the command line overrides them."""

    def __post_init__(self) -> None:
        known = [*kernel_names(), "auto"]
        if self.attention_kernel not in known:
            raise ValueError(f"attention_kernel must be one of {', '.join(known)}; got {self.attention_kernel!r}")


def load_config(path: str | Path) -> ParadyseConfig:
    """Read, validate and resolve a paradyse YAML config (paths made relative to its folder)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the paradyse config {path}: {e.strerror}") from e
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader
    except _RepeatedKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    errors: list[str] = []
    config = _build(ParadyseConfig, data, "", errors)
    if errors:
        raise ConfigError(f"{path}:\n  " + "\n  ".join(errors))
    return _resolve_paths(config, path.parent)


class _RepeatedKey(yaml.YAMLError):
    """A key given twice in one mapping."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers in exponent form without a dot as floats: PyYAML follows
    YAML 1.1, where ``1e-30`` is a string; YAML 1.2 (and every user) reads it as a number. A key given
    twice in one mapping is refused: PyYAML would keep the second and drop the first's section silently."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *defaults" and the keys after it that override its keys
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in lines:
                where = f"lines {lines[key]} and {line}" if lines[key] != line else f"both on line {line}"
                raise _RepeatedKey(f"key {key!r} appears twice ({where}); merge the two")
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _resolve_paths(config: ParadyseConfig, base: Path) -> ParadyseConfig:
    def resolve(value: str | None) -> str | None:
        return None if value is None else str((base / Path(value).expanduser()).resolve())

    data = config.data
    if data.dataset not in ("code", "dna"):
        data = dataclasses.replace(data, dataset=resolve(data.dataset))
    return dataclasses.replace(
        config,
        cost=dataclasses.replace(config.cost, profile=resolve(config.cost.profile)),
        data=dataclasses.replace(data, cache_dir=resolve(data.cache_dir)),
        log=dataclasses.replace(config.log, plot=resolve(config.log.plot), jsonl=resolve(config.log.jsonl)),
    )


_REMOVED = {
    "log.every": "no longer a key: the table follows Megatron's --log-interval (megatron_args or the command line)",
}
"""Keys older configs may still hold, with what replaced them."""


def _build(cls: type, data: Mapping, where: str, errors: list[str]) -> Any:
    """``cls(**data)``, converting nested sections; problems go to ``errors`` (returns None then)."""
    hints = _key_types(cls)
    names = list(hints)
    n_before = len(errors)
    for key in data:
        if f"{where}{key}" in _REMOVED:
            errors.append(f"{where}{key}: {_REMOVED[f'{where}{key}']}")
        elif key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(names)}"
            errors.append(f"{where}{key}: unknown key{hint}")
    kwargs = {name: _convert(data[name], hints[name], f"{where}{name}", errors) for name in names if name in data}
    if len(errors) > n_before:
        return None
    try:
        return cls(**kwargs)
    except ValueError as e:  # the section's own check; its message names the key
        errors.append(str(e))
        return None


def _key_types(cls: type) -> dict[str, Any]:
    """The keys of section ``cls`` and their types, in order: its fields', with the keys of a group (a
    field whose metadata says ``flat``, as :class:`~megatron_paradyse.planner.PlannerConfig`'s) in the
    group's place. The section's constructor takes them flat."""
    hints = typing.get_type_hints(cls)
    keys = {}
    for field in dataclasses.fields(cls):
        if field.metadata.get("flat"):
            keys.update(_key_types(hints[field.name]))
        else:
            keys[field.name] = hints[field.name]
    return keys


def section_keys(section: object) -> dict[str, Any]:
    """A config or one of its sections as the mapping its YAML holds (what :func:`load_config` reads back
    to an equal one): sections as mappings, a group's keys in the group's place."""
    keys = {}
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if field.metadata.get("flat"):
            keys.update(section_keys(value))
        else:
            keys[field.name] = section_keys(value) if dataclasses.is_dataclass(value) else value
    return keys


def _convert(value: Any, hint: Any, where: str, errors: list[str]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            errors.append(f"{where}: must be a mapping of {hint.__name__} keys, got {value!r}")
            return None
        return _build(hint, value, f"{where}.", errors)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where, errors) if len(inner) == 1 else value
    if origin is Literal:
        if value not in args:
            errors.append(f"{where}: must be one of {', '.join(map(repr, args))}; got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            errors.append(f"{where}: must be a list, got {value!r}")
            return None
        return tuple(_convert(v, args[0], f"{where}[{i}]", errors) for i, v in enumerate(value))
    if hint is float:
        return _float(value, where, errors)
    if hint is _Word and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a number written plainly in a flag list (``--lr, 3e-4``) means its text
    if hint is _Word:
        hint = str
    if hint in (int, str, bool) and (type(value) is not hint):
        errors.append(f"{where}: must be {hint.__name__}, got {value!r}")
        return None
    return value


def _float(value: Any, where: str, errors: list[str]) -> float | None:
    """A float key's value: a finite number (an int converts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        errors.append(f"{where}: must be float, got {value!r}")
        return None
    if not math.isfinite(value):
        errors.append(f"{where}: must be a finite number, got {value!r}")
        return None
    return float(value)

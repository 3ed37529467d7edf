"""The cost profile: what ``paradyse calibrate`` measured on a machine, as a versioned JSON file.

Schema (version 2: adds ``broadcast`` and ``reduce``, which ``lean`` streams its shards with),
all times in seconds, sizes in bytes::

    {
      "schema": "megatron-paradyse/cost-profile", "version": 2,
      "created": "2025-01-01T00:00:00+00:00", "grid": "quick" | "full",
      "fingerprint": {"device": "cpu" | "cuda", "device_name": str, "cpu_count": int,
                      "torch": str, "megatron_core": str, "python": str, "hostname": str},
      "dtype": "float32", "concurrency": 4,          # ranks computing at once while measured
      "gemm": {"forward": GEMM, "backward": GEMM},
      "attention": {"kernel": "torch",
                    "forward": {"causal": RATE, "full": RATE},
                    "backward": {"causal": RATE, "full": RATE}},
      "elementwise": {"per_byte_s": float, "per_op_s": float},
      "collectives": {"<p>": {"all_gather": ALPHA_BETA, "reduce_scatter": ..., "all_to_all": ...,
                              "send_recv": ..., "broadcast": ..., "reduce": ...}},
      "ring_overlap": float,                          # fraction of the shorter of comm/compute hidden
      "host_link": {"latency_s": a, "per_byte_s": b,  # optional: one device<->host copy (offload),
                    "overlap": float},                # and the fraction of it compute hides
      "allocator_slack": float,                       # fraction of the transient added to a peak
      "correction": null | {"compute": k, "comm": k, "per_sync_s": c, "per_layer_s": c,
                            "fitted_on": ["tp_sp/tp_sp@512", ...],
                            "metered": bool},         # optional: its layers timed under the memory meter
      "model": null | {"shape": {...}, "p": int,      # optional: the model whose own GEMMs and attention
                       "longest": int},               # were measured too (calibration.grid.model_grid)
      "samples": {...}                                # the raw measurements the fits came from
    }

with ``GEMM = {"coef": [c0, c1, c2], "by_shape": {"<n>x<k>": {"m": [m...], "per_flop_s": [r...]}}}``
(a measured ``(n, k)``: time = r(m) * FLOPs, ``r`` interpolated in log m; any other: time = c0 + c1 *
FLOPs + c2 * bytes; ``by_shape`` is optional), ``RATE =
{"per_call_s": c0, "by_head_dim": {"<hn>": {"lengths": [L...], "per_unit_s": [r...]}}}`` (time = c0 +
r(L) * pairs * hn * heads * b at the nearest calibrated head dim, ``r`` interpolated in log length;
``L`` = sq causal, sqrt(sq sk) full) and
``ALPHA_BETA = {"latency_s": a, "per_byte_s": b}``. Loading checks everything a cost model reads,
field by field (present, of its type, finite, in its range), and raises :class:`ProfileError` naming
the file, the field and what to do.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_paradyse.strategies.terms import COLLECTIVE_KINDS

__all__ = ["PROFILE_SCHEMA", "PROFILE_VERSION", "ProfileError", "fingerprint", "load_profile", "save_profile"]

PROFILE_SCHEMA = "megatron-paradyse/cost-profile"
PROFILE_VERSION = 2
# What must match between the machine that calibrated and the one that plans.
_MUST_MATCH = ("device", "device_name", "torch", "megatron_core")


class ProfileError(ValueError):
    """A cost profile that is missing, corrupt, of another version or machine, or incomplete."""


def fingerprint(device: str = "cpu") -> dict[str, Any]:
    """What identifies the machine and software a profile is valid for."""
    if device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = _cpu_model()
    return {
        "device": device,
        "device_name": device_name,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core"),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


def _version(distribution: str) -> str | None:
    # from the installed metadata: importing megatron.core on CPU needs patches (megatron_on_cpu.md)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def save_profile(profile: dict[str, Any], path: str | os.PathLike) -> None:
    profile = {"schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, **profile}
    profile.setdefault("created", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    _check(profile, str(path))
    path = Path(path)
    # whole or not at all: the tensor-parallel groups of a job may each save the profile they calibrated
    written = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        written.write_text(json.dumps(profile, indent=1, sort_keys=True) + "\n")
        os.replace(written, path)
    finally:
        written.unlink(missing_ok=True)


def load_profile(
    path: str | os.PathLike,
    *,
    p: int | None = None,
    check_machine: bool = True,
    device: str | None = None,
    host_link: bool = False,
) -> dict[str, Any]:
    """Read and validate a profile; ``p``: require collectives for that group size; ``check_machine``:
    require this machine's device and torch/megatron-core versions (what rates depend on); ``host_link``:
    require the host-device copy rates (a planner that may offload layer inputs prices them)."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"cost profile {path} does not exist; make one with `paradyse calibrate --output {path}`")
    try:
        profile = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"cost profile {path} is not valid JSON ({e}); recalibrate with `paradyse calibrate`") from e
    _check(profile, str(path))
    if p is not None and p > 1 and str(p) not in profile["collectives"]:
        raise ProfileError(
            f"cost profile {path} has no collectives for p={p} (calibrated for p in "
            f"{sorted(profile['collectives'], key=int)}); run `paradyse calibrate --p {p}`"
        )
    if host_link and "host_link" not in profile:
        raise ProfileError(
            f"cost profile {path} has no host_link (host-device copy rates, which price layer inputs offloaded "
            f"to host memory: planner.host_memory_gib > 0); recalibrate with `paradyse calibrate`, or set "
            f"planner.host_memory_gib: 0"
        )
    if check_machine:
        here = fingerprint(device or profile["fingerprint"]["device"])
        diffs = [
            f"{k}: profile {profile['fingerprint'].get(k)!r}, here {here[k]!r}"
            for k in _MUST_MATCH
            if profile["fingerprint"].get(k) != here[k]
        ]
        if diffs:
            raise ProfileError(
                f"cost profile {path} was calibrated on another machine or software ({'; '.join(diffs)}); "
                f"recalibrate here with `paradyse calibrate`, or pass check_machine=False to use it anyway"
            )
    return profile


def _check(profile: Any, where: str) -> None:
    if not isinstance(profile, dict):
        raise ProfileError(f"cost profile {where} must be a JSON object, got {type(profile).__name__}")
    if profile.get("schema") != PROFILE_SCHEMA:
        raise ProfileError(f"{where} is not a cost profile (schema {profile.get('schema')!r}, want {PROFILE_SCHEMA!r})")
    if profile.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"cost profile {where} has version {profile.get('version')!r}; this megatron-paradyse reads version "
            f"{PROFILE_VERSION} (it prices collectives the older one did not measure): recalibrate with "
            f"`paradyse calibrate`"
        )
    missing = [key for key in _required_keys(profile) if _lookup(profile, key) is None]
    if missing:
        raise ProfileError(f"cost profile {where} lacks {', '.join(missing)}; recalibrate with `paradyse calibrate`")
    bad = list(_bad_values(profile))
    if bad:
        raise ProfileError(
            f"cost profile {where} has values a cost model cannot use: {'; '.join(bad)}; recalibrate with "
            f"`paradyse calibrate`"
        )


_DTYPES = ("float32", "bfloat16", "float16")


def _bad_values(profile: dict[str, Any]) -> Iterable[str]:
    """``"field: what is wrong (the value)"`` for every value of a complete profile a cost model cannot use."""

    def number(key: str, value: Any, low: float = 0.0, high: float = math.inf, *, low_open: bool = False):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} must be a number, got {value!r}"
        if not math.isfinite(value):
            return f"{key} must be finite, got {value!r}"
        if value < low or (low_open and value == low) or value > high:
            opening = "(" if low_open else "["
            closing = "]" if math.isfinite(high) else ")"
            return f"{key} must be in {opening}{low:g}, {high:g}{closing}, got {value!r}"
        return None

    def numbers(key: str, values: Any, length: int | None = None, **bounds):
        if not isinstance(values, list) or not values or (length is not None and len(values) != length):
            return [f"{key} must be a list of {length or 'one or more'} numbers, got {values!r}"]
        return [number(f"{key}[{i}]", v, **bounds) for i, v in enumerate(values)]

    checks = [
        None if profile["fingerprint"]["device"] in ("cpu", "cuda") else
        f"fingerprint.device must be 'cpu' or 'cuda', got {profile['fingerprint']['device']!r}",
        None if profile["dtype"] in _DTYPES else f"dtype must be one of {', '.join(_DTYPES)}, got {profile['dtype']!r}",
        None if type(profile["concurrency"]) is int and profile["concurrency"] >= 1 else
        f"concurrency must be a positive int, got {profile['concurrency']!r}",
        None if isinstance(profile["attention"]["kernel"], str) else
        f"attention.kernel must be a kernel name, got {profile['attention']['kernel']!r}",
        number("ring_overlap", profile["ring_overlap"], high=1.0),
        number("allocator_slack", profile["allocator_slack"]),
        number("elementwise.per_byte_s", profile["elementwise"]["per_byte_s"]),
        number("elementwise.per_op_s", profile["elementwise"]["per_op_s"]),
    ]  # fmt: skip
    for direction in ("forward", "backward"):
        checks += numbers(f"gemm.{direction}.coef", profile["gemm"][direction]["coef"], length=3)
        if "by_shape" in profile["gemm"][direction]:
            by_shape = profile["gemm"][direction]["by_shape"]
            checks += _rate_tables(
                f"gemm.{direction}.by_shape", by_shape, numbers, "GEMM shapes", "'<n>x<k>'", "m", "per_flop_s"
            )
        for mask in ("causal", "full"):
            rate = profile["attention"][direction][mask]
            key = f"attention.{direction}.{mask}"
            checks.append(number(f"{key}.per_call_s", rate["per_call_s"]))
            checks += _rate_tables(
                f"{key}.by_head_dim", rate["by_head_dim"], numbers, "head dims", "'<hn>'", "lengths", "per_unit_s"
            )
    for p, kinds in profile["collectives"].items():
        if not (isinstance(p, str) and p.isdigit() and int(p) >= 2):
            checks.append(f"collectives: keys are group sizes >= 2 as strings, got {p!r}")
        for kind in COLLECTIVE_KINDS:
            for field in ("latency_s", "per_byte_s"):
                checks.append(number(f"collectives.{p}.{kind}.{field}", kinds[kind][field]))
    link = profile.get("host_link")
    if link is not None:
        if not isinstance(link, dict) or any(field not in link for field in ("latency_s", "per_byte_s", "overlap")):
            checks.append(f"host_link must be a mapping of latency_s, per_byte_s and overlap, got {link!r}")
        else:
            checks += [number(f"host_link.{field}", link[field]) for field in ("latency_s", "per_byte_s")]
            checks.append(number("host_link.overlap", link["overlap"], high=1.0))
    correction = profile.get("correction")
    if correction is not None:
        if not isinstance(correction, dict):
            checks.append(f"correction must be null or a mapping, got {correction!r}")
        else:
            for field, bounds in (("compute", {"low_open": True}), ("comm", {"low_open": True}), ("per_sync_s", {}),
                                  ("per_layer_s", {})):  # fmt: skip
                checks.append(number(f"correction.{field}", correction.get(field), **bounds))
    return [c for c in checks if c is not None]


def _rate_tables(key: str, tables: Any, numbers, names: str, form: str, x: str, y: str) -> list[str | None]:
    """Rates to interpolate, one table per key of ``form``, positive integers joined by ``x`` (a head dim
    ``"128"``, a GEMM shape ``"4096x14336"``): increasing positive ``x`` and a rate ``y`` at each."""
    if not isinstance(tables, dict) or not tables:
        return [f"{key} must be a mapping of {names} to rates, got {tables!r}"]
    problems: list[str | None] = []
    for name, table in tables.items():
        where = f"{key}.{name}"
        parts = name.split("x") if isinstance(name, str) else [""]
        if len(parts) != form.count("x") + 1 or not all(part.isdigit() and int(part) >= 1 for part in parts):
            problems.append(f"{key}: keys are {names} as strings {form}, got {name!r}")
        if not isinstance(table, dict):
            problems.append(f"{where} must be a mapping with {x} and {y}, got {table!r}")
            continue
        xs = table.get(x)
        problems += numbers(f"{where}.{x}", xs, low=0.0, low_open=True)
        problems += numbers(f"{where}.{y}", table.get(y), length=len(xs or []) or None)
        if isinstance(xs, list) and all(isinstance(v, (int, float)) for v in xs):
            if any(b <= a for a, b in zip(xs, xs[1:])):
                problems.append(f"{where}.{x} must increase, got {xs!r}")
    return problems


def _required_keys(profile: dict[str, Any]) -> Iterable[str]:
    yield from ("fingerprint.device", "fingerprint.torch", "fingerprint.megatron_core", "dtype", "concurrency")
    yield from ("gemm.forward.coef", "gemm.backward.coef", "elementwise.per_byte_s", "elementwise.per_op_s")
    yield from ("attention.kernel", "ring_overlap", "allocator_slack", "collectives")
    for direction in ("forward", "backward"):
        for mask in ("causal", "full"):
            yield f"attention.{direction}.{mask}.per_call_s"
            yield f"attention.{direction}.{mask}.by_head_dim"
    for p in (profile.get("collectives") or {}) if isinstance(profile.get("collectives"), dict) else ():
        for kind in COLLECTIVE_KINDS:
            yield f"collectives.{p}.{kind}.latency_s"
            yield f"collectives.{p}.{kind}.per_byte_s"


def _lookup(profile: dict[str, Any], dotted: str) -> Any:
    node: Any = profile
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node

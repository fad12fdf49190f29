"""Read and validate variants.yaml.

Every error is a :class:`ConfigError` that names the file, the line and the offending key or value.
The schema (see README.md, "variants.yaml reference"):

    dims:    {kv_lora_rank: 512, qk_rope_head_dim: 64}   # fixed; anything else is rejected
    arch:    sm_90a
    axes:    {num_heads: [...], page_size: [...], dtype: [...], split: [...]}
    presets: {<name>: {description: str, num_heads: [...], page_size: [...], dtype: [...], split: [...]}}
    exclude: [{<axis or path>: [...], ...}, ...]          # optional

A preset selects a subset of the axes (a missing axis means all of its values); a value outside the
axes is an impossible combination. An exclude rule drops every variant whose value on each axis the
rule names is among the rule's values (the axes it does not name match anything), from the full build
and from every preset, as CUTLASS's generator leaves out the kernels its filters reject. A rule may
also name `path`: the kernel path a variant runs (PathFacts: "transposed" for at most 32 heads,
"rows64" above), so that a rule about a path keeps holding for head counts added later. A variant no
call dispatches to is never in a selection (codegen.variant.call_dtype: fp8_e4m3_fast at most 32 heads,
which the fp8_e4m3 variants serve).
"""
from __future__ import annotations

import itertools
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .variant import DTYPES, FP8_FAST, ST_MAX_HEADS, Variant, call_dtype

AXES = ("num_heads", "page_size", "dtype", "split")
PATHS = ("transposed", "rows64")  # exclude rules' `path` values (Variant.path)
SUPPORTED_ARCHS = ("sm_90a",)
FIXED_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
MAX_NUM_HEADS = 128  # rows beyond this are served by launching head groups
MAX_PAGE_SIZE = 1024


_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("int", "bool", "str", "null", "float")}


class ConfigError(ValueError):
    """variants.yaml is malformed; the message names file:line and the key or value."""

    def __init__(self, path: str, line: int | None, message: str):
        self.path, self.line = path, line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    axes: dict[str, tuple]
    line: int
    exclude: tuple = ()

    def variants(self) -> list[Variant]:
        """The preset's selection of the axes, less what an exclude rule drops, sorted by name."""
        return _product(self.axes, self.exclude)

    def cross_product(self) -> list[Variant]:
        """The preset's selection of the axes (less the variants no call runs), exclude rules not applied."""
        return _product(self.axes)


@dataclass(frozen=True)
class Config:
    path: str
    text: str
    arch: str
    dims: dict[str, int]
    axes: dict[str, tuple]
    axis_lines: dict[str, int]
    presets: dict[str, Preset] = field(default_factory=dict)
    exclude: tuple = ()  # ExcludeRule, in file order

    def variants(self) -> list[Variant]:
        """The cross product of the axes less what an exclude rule drops, sorted by name."""
        return _product(self.axes, self.exclude)

    def cross_product(self) -> list[Variant]:
        """The cross product of the axes (less the variants no call runs), exclude rules not applied."""
        return _product(self.axes)

    def excluded_by(self, v: Variant) -> list["ExcludeRule"]:
        """The exclude rules that drop variant v (empty if none does), in file order."""
        return [r for r in self.exclude if r.drops(v)]


@dataclass(frozen=True)
class ExcludeRule:
    """One entry of `exclude:`: axis -> the values it drops (a variant must match every named axis)."""
    values: dict[str, tuple]
    line: int

    def drops(self, v: Variant) -> bool:
        fields = dict(zip(AXES, (v.num_heads, v.page_size, v.dtype, v.split)), path=v.path)
        return all(fields[axis] in vals for axis, vals in self.values.items())


def raw_product(axes: dict[str, tuple]) -> list[Variant]:
    """Every combination of the axes, including variants no call dispatches to."""
    return [Variant(h, p, d, s) for h, p, d, s in itertools.product(*(axes[a] for a in AXES))]


def _product(axes: dict[str, tuple], exclude: tuple = ()) -> list[Variant]:
    # A variant no call dispatches to is not a variant (call_dtype: fp8_e4m3_fast at most 32 heads).
    out = {v for v in raw_product(axes) if call_dtype(v.dtype, v.num_heads) == v.dtype}
    return sorted((v for v in out if not any(r.drops(v) for r in exclude)), key=lambda v: v.name)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


class _Reader:
    def __init__(self, path: str):
        self.path = path

    def fail(self, node: yaml.Node | None, message: str) -> None:
        raise ConfigError(self.path, _line(node) if node is not None else None, message)

    def mapping(self, node: yaml.Node, what: str, allowed: tuple[str, ...], required: tuple[str, ...] = (),
                owner: yaml.Node | None = None):
        """Check a mapping's keys; a missing key is reported at `owner` (the key that holds the mapping)."""
        if not isinstance(node, yaml.MappingNode):
            self.fail(node, f"{what}: expected a mapping, got {node.tag.rsplit(':', 1)[-1]}")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key not in allowed:
                self.fail(k, f"{what}: unknown key {key!r}; allowed keys are {', '.join(allowed)}")
            if key in out:
                self.fail(k, f"{what}: key {key!r} appears twice")
            out[key] = (k, v)
        for key in required:
            if key not in out:
                self.fail(owner if owner is not None else node, f"{what}: missing required key {key!r}")
        return out

    def scalar(self, node: yaml.Node, what: str, kind: type):
        """A plain scalar of the given kind. Only the obvious spellings count: decimal digits for an
        integer (no YAML 1.1 octal, hex, sexagesimal or underscores), true/false for a bool, a
        non-empty string; explicit tags are refused."""
        text = node.value if isinstance(node, yaml.ScalarNode) else None
        shown = repr(text) if text is not None else f"a {type(node).__name__.replace('Node', '').lower()}"
        explicit_tag = isinstance(node, yaml.ScalarNode) and node.tag not in _PLAIN_TAGS
        if kind is int:
            if text is None or explicit_tag or node.style is not None or not re.fullmatch(r"0|[1-9][0-9]*", text):
                self.fail(node, f"{what}: expected an integer, got {shown if len(shown) <= 40 else shown[:37] + '...'}")
            if len(text) > 18:  # every field's bound is far below; int() itself refuses 4300+ digits
                self.fail(node, f"{what}: expected an integer of at most 18 digits, got one of {len(text)} digits")
            return int(text)
        if kind is bool:
            if text is None or explicit_tag or node.style is not None or text not in ("true", "false", "True", "False"):
                self.fail(node, f"{what}: expected true or false, got {shown}")
            return text.lower() == "true"
        if text is None or explicit_tag or (node.style is None and node.tag != "tag:yaml.org,2002:str") or not text.strip():
            self.fail(node, f"{what}: expected a non-empty string, got {shown}")
        return text

    def path_values(self, node: yaml.Node, what: str) -> tuple:
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            got = node.value if isinstance(node, yaml.ScalarNode) else "an empty list" if isinstance(node, yaml.SequenceNode) else "a mapping"
            self.fail(node, f"{what}: expected a list such as [transposed], got {got!r}")
        values = []
        for item in node.value:
            v = self.scalar(item, what, str)
            if v not in PATHS:
                self.fail(item, f"{what}: unknown path {v!r}; paths: {', '.join(PATHS)}")
            if v in values:
                self.fail(item, f"{what}: value {v!r} is listed twice")
            values.append(v)
        return tuple(values)

    def axis_values(self, axis: str, node: yaml.Node, what: str) -> tuple:
        if not isinstance(node, yaml.SequenceNode):
            self.fail(node, f"{what}: expected a list such as [{'16, 64' if axis in ('num_heads', 'page_size') else 'bf16' if axis == 'dtype' else 'false, true'}], got {node.value if isinstance(node, yaml.ScalarNode) else 'a mapping'!r}")
        items = node.value
        if not items:
            self.fail(node, f"{what}: expected at least one value")
        values = []
        for item in items:
            if axis in ("num_heads", "page_size"):
                v = self.scalar(item, what, int)
                hi = MAX_NUM_HEADS if axis == "num_heads" else MAX_PAGE_SIZE
                if not 1 <= v <= hi:
                    self.fail(item, f"{what}: expected an integer from 1 to {hi}, got {v}")
            elif axis == "dtype":
                v = self.scalar(item, what, str)
                if v not in DTYPES:
                    self.fail(item, f"{what}: unknown dtype {v!r}; supported: {', '.join(DTYPES)}")
            else:
                v = self.scalar(item, what, bool)
            if v in values:
                self.fail(item, f"{what}: value {v!r} is listed twice")
            values.append(v)
        return tuple(values)


MAX_CONFIG_BYTES = 1 << 20  # variants.yaml is a few KiB; more is a wrong file (e.g. /dev/zero)


def load_config(path: str | Path) -> Config:
    """Parse and validate variants.yaml; raises ConfigError (file:line: message) on any problem."""
    path = str(path)
    if "\0" in path:
        raise ConfigError(path.replace("\0", "\\0"), None, "not a usable path (it holds a NUL byte)")
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)  # a FIFO would block open(), a device never end
        if regular:
            with open(path, "rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(path, None, f"cannot read the variants file: {e.strerror}") from None
    if not regular:
        raise ConfigError(path, None, "a regular file expected (the variants file)")
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(path, None, f"a variants file of at most {MAX_CONFIG_BYTES} bytes expected (is it the right file?)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(path, data.count(b"\n", 0, e.start) + 1, f"not UTF-8 text (byte {data[e.start]:#04x})") from None
    return parse_config(text, path)


def parse_config(text: str, path: str = "variants.yaml") -> Config:
    r = _Reader(path)
    try:
        root = yaml.compose(text)
    except RecursionError:
        raise ConfigError(path, None, "not valid YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        if line is None and isinstance(getattr(e, "position", None), int):  # reader errors carry a position
            line = text.count("\n", 0, e.position) + 1
        raise ConfigError(path, line, f"not valid YAML: {getattr(e, 'problem', None) or getattr(e, 'reason', e)}") from None
    if root is None:
        raise ConfigError(path, None, "the file is empty; expected keys dims, arch, axes")
    top = r.mapping(root, "top level", ("dims", "arch", "axes", "presets", "exclude"), ("dims", "arch", "axes"))

    dims_node = top["dims"][1]
    dims = {}
    for key, (k, v) in r.mapping(dims_node, "dims", tuple(FIXED_DIMS), tuple(FIXED_DIMS), top["dims"][0]).items():
        dims[key] = r.scalar(v, f"dims.{key}", int)
        if dims[key] != FIXED_DIMS[key]:
            r.fail(v, f"dims.{key}: only {FIXED_DIMS[key]} is supported (the DeepSeek MLA layout), got {dims[key]}")

    arch_node = top["arch"][1]
    arch = r.scalar(arch_node, "arch", str)
    if arch not in SUPPORTED_ARCHS:
        r.fail(arch_node, f"arch: expected one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")

    axes: dict[str, tuple] = {}
    axis_lines: dict[str, int] = {}
    for key, (k, v) in r.mapping(top["axes"][1], "axes", AXES, AXES, top["axes"][0]).items():
        axes[key] = r.axis_values(key, v, f"axes.{key}")
        axis_lines[key] = _line(k)
    if not _product(axes):
        r.fail(top["axes"][1], f"axes: every combination is an {FP8_FAST} variant of at most {ST_MAX_HEADS} heads, which no "
                               f"call runs (codegen.variant.call_dtype: such calls run fp8_e4m3); add a head count above "
                               f"{ST_MAX_HEADS} or another dtype")

    exclude: list[ExcludeRule] = []
    if "exclude" in top:
        enode = top["exclude"][1]
        if not isinstance(enode, yaml.SequenceNode):
            r.fail(enode, "exclude: expected a list of rules such as {split: [false], num_heads: [8, 16]}")
        for i, rule in enumerate(enode.value):
            fields = r.mapping(rule, f"exclude[{i}]", AXES + ("path",))
            if not fields:
                r.fail(rule, f"exclude[{i}]: expected at least one axis (an empty rule would drop every variant)")
            vals = {}
            for axis, (k, v) in fields.items():
                if axis == "path":
                    vals[axis] = r.path_values(v, f"exclude[{i}].path")
                    continue
                vals[axis] = r.axis_values(axis, v, f"exclude[{i}].{axis}")
                for val, item in zip(vals[axis], v.value):
                    if val not in axes[axis]:
                        r.fail(item, f"exclude[{i}].{axis}: {val!r} is not in axes.{axis} {list(axes[axis])} "
                                     f"(line {axis_lines[axis]}), so the rule can never apply; remove it here")
            exclude.append(ExcludeRule(vals, _line(rule)))
            if not any(exclude[-1].drops(v) for v in raw_product(axes)):
                r.fail(rule, f"exclude[{i}]: matches no variant of the axes (e.g. a path no head count in "
                             f"axes.num_heads runs), so the rule can never apply; remove it")
        if not _product(axes, tuple(exclude)):
            r.fail(enode, "exclude: the rules drop every variant of the axes")

    presets: dict[str, Preset] = {}
    if "presets" in top:
        pnode = top["presets"][1]
        if not isinstance(pnode, yaml.MappingNode):
            r.fail(pnode, "presets: expected a mapping of preset name -> selection")
        for k, v in pnode.value:
            name = r.scalar(k, "presets", str)
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
                r.fail(k, f"presets: preset names are letters, digits, '.', '_' and '-', got {name!r}")
            if name in presets:
                r.fail(k, f"presets: preset {name!r} is defined twice")
            fields = r.mapping(v, f"presets.{name}", ("description",) + AXES, ("description",), k)
            sel = dict(axes)
            for axis in AXES:
                if axis not in fields:
                    continue
                vals = r.axis_values(axis, fields[axis][1], f"presets.{name}.{axis}")
                for val, item in zip(vals, fields[axis][1].value):
                    if val not in axes[axis]:
                        r.fail(item, f"presets.{name}.{axis}: impossible combination: {val!r} is not in axes.{axis} "
                                     f"{list(axes[axis])} (line {axis_lines[axis]}); add it there, or remove it here")
                sel[axis] = vals
            presets[name] = Preset(name, r.scalar(fields["description"][1], f"presets.{name}.description", str), sel,
                                   _line(k), tuple(exclude))
            if not presets[name].variants():
                r.fail(k, f"presets.{name}: every variant it selects is dropped by an exclude rule (or is an "
                          f"fp8_e4m3_fast variant of at most {ST_MAX_HEADS} heads, which no call runs: codegen.variant.call_dtype)")
    return Config(path, text, arch, dims, axes, axis_lines, presets, tuple(exclude))

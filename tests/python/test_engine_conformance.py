"""The connectors against the engines' interfaces, version by version, without the engines installed.

tests/python/engine_interfaces/*.toml write down, per engine version the connectors claim, what the engine calls on
a connector (vLLM's KVConnectorBase_V1 and SupportsHMA) or a storage backend (SGLang's HiCacheStorage): names,
parameters, how the engine passes its arguments, what is abstract, what the base does by default and the shape of
what the engine reads back (README.md there). This module builds stand-ins of each version's base classes from
those files, builds FlexKVdConnector / FlexKVdStorage against them (as vLLM's factory and SGLang's loader would:
the adapter module imports the engine's classes), and checks every entry:

  - the attribute exists with the engine's kind (method, classmethod, property), the engine's calls bind to its
    signature, and its parameters carry the base's names in the base's order;
  - abstract methods are implemented, and methods whose base default does not fit a cache are overridden;
  - driven in the engine's order against a real flexkvd, each call answers with the shape the engine reads.

A data entry the connector does not meet fails naming the method, the engine version and what differs. Cases that
other work of issue 31 is adding are marked xfail(strict=True) in KNOWN_GAPS: when the work lands they pass, the
xfail turns into a failure, and the marker is removed.
"""
from __future__ import annotations

import abc
import ast
import copy
import dataclasses
import enum
import glob
import importlib
import inspect
import os
import pickle
import sys
import time
import tomllib
import types
from types import SimpleNamespace as NS_
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

import flexkvd
from vllm_harness import BS, NS, HostKvEngine, prompt

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_FILES = sorted(glob.glob(os.path.join(HERE, "engine_interfaces", "*.toml")))


def _load(path: str) -> Dict[str, Any]:
    with open(path, "rb") as f:
        spec = tomllib.load(f)
    spec["file"] = os.path.basename(path)
    return spec


SPECS = [_load(p) for p in SPEC_FILES]

# (engine, entry, check) -> the issue 31 work that adds it; check is "entry" (test_the_connector_has_each_entry_...)
# or "value" (test_values_the_engine_documents_...). Each is xfail(strict=True) in every version that has the entry.
KNOWN_GAPS = {
}


def _where(spec: Dict[str, Any]) -> str:
    return f"{spec['engine']} {spec['version']} ({spec['file']})"


# ---- shapes: what the engine reads back ----

def _split_top(text: str, sep: str) -> List[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


_PLAIN = {"bool": bool, "str": str, "set": (set, frozenset), "dict": dict, "list": list, "tuple": tuple}


def shape_mismatch(shape: str, value: Any, named: Dict[str, type]) -> Optional[str]:
    """None when `value` has `shape` (README.md's grammar), else what differs. ValueError for a shape the grammar
    does not know (a data file error)."""
    alternatives = _split_top(shape, "|")
    if len(alternatives) > 1:
        whys = [shape_mismatch(a, value, named) for a in alternatives]
        return None if any(w is None for w in whys) else f"{value!r} is none of {shape}"
    s = alternatives[0]
    head, _, inner = s.partition("[")
    inner = inner[:-1] if inner else ""
    if head == "any":
        return None
    if head == "None":
        return None if value is None else f"{value!r} is not None"
    if head == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif head == "iterable":
        try:
            iter(value)
            ok = True
        except TypeError:
            ok = False
    elif head in _PLAIN:
        ok = isinstance(value, _PLAIN[head])
    elif head in named:
        ok = isinstance(value, named[head])
    else:
        raise ValueError(f"shape {shape!r}: unknown type {head!r}")
    if not ok:
        return f"{value!r} ({type(value).__name__}) is not {s}"
    if inner:
        args = _split_top(inner, ",")
        if head == "tuple":
            if len(value) != len(args):
                return f"{value!r} has {len(value)} elements; {s} has {len(args)}"
            items = list(zip(args, value))
        elif head in ("set", "list"):
            items = [(args[0], v) for v in value]
        elif head == "dict":
            items = [(args[0], k) for k in value] + [(args[1], v) for v in value.values()]
        else:
            raise ValueError(f"shape {shape!r}: {head} takes no element types")
        for element_shape, element in items:
            why = shape_mismatch(element_shape, element, named)
            if why is not None:
                return f"in {value!r}: {why}"
    return None


# ---- stand-ins of the engine's classes, made from a data file ----

def _literal(text: str) -> Any:
    return ast.literal_eval(text)


def _signature(params: List[Dict[str, Any]], first: Optional[str] = "self") -> inspect.Signature:
    kinds = {"var_keyword": inspect.Parameter.VAR_KEYWORD, "var_positional": inspect.Parameter.VAR_POSITIONAL}
    out = [inspect.Parameter(first, inspect.Parameter.POSITIONAL_OR_KEYWORD)] if first else []
    for p in params:
        kind = kinds.get(p.get("kind"), inspect.Parameter.POSITIONAL_OR_KEYWORD)
        default = _literal(p["default"]) if "default" in p else inspect.Parameter.empty
        out.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(out)


def _dataclass(name: str, fields: List[Dict[str, Any]], module: str, namespace: Optional[dict] = None) -> type:
    made = []
    for f in fields:
        if "default" not in f:
            made.append((f["name"], Any))
            continue
        value = _literal(f["default"])
        if isinstance(value, (dict, list, set)):
            made.append((f["name"], Any, dataclasses.field(default_factory=lambda v=value: copy.copy(v))))
        else:
            made.append((f["name"], Any, dataclasses.field(default=value)))
    cls = dataclasses.make_dataclass(name, made, namespace=namespace or {})
    cls.__module__ = module
    return cls


class StandIn:
    """One engine version's classes, made from its data file: the base class, its mixins, the metadata and stats
    containers and the plain types (dataclasses) its calls carry, in module objects named as the engine names
    them. The base's methods check each call against the signature written down, then do what the data says the
    base does (`base_default`)."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.spec = spec
        base_module = spec["modules"]["base"]
        self.types: Dict[str, type] = {}
        for name, t in spec.get("types", {}).items():
            self.types[name] = _dataclass(name, t["fields"], base_module)
        self.metadata = None
        if "metadata_class" in spec["connector"]:
            self.metadata = abc.ABCMeta(spec["connector"]["metadata_class"], (abc.ABC,), {"__module__": base_module})
            self.types[self.metadata.__name__] = self.metadata
        self.stats = None
        if "stats" in spec:
            methods = {m["name"]: self._method(m, default="raise_not_implemented") for m in spec["stats"]["method"]}
            self.stats = _dataclass(spec["stats"]["class"], spec["stats"].get("fields", []),
                                    spec["modules"]["stats"], methods)
            self.types[self.stats.__name__] = self.stats
        self.role = enum.Enum("KVConnectorRole", {"SCHEDULER": 0, "WORKER": 1}) if spec["engine"] == "vllm" else None
        self.mixins: Dict[str, type] = {}
        for mixin in spec.get("mixin", []):
            ns = {m["name"]: self._method(m) for m in mixin["method"]}
            ns["__module__"] = base_module
            self.mixins[mixin["name"]] = abc.ABCMeta(mixin["name"], (abc.ABC,), ns)
        ns: Dict[str, Any] = {"__module__": base_module}
        if "base_sets" in spec["constructor"]:
            ns["__init__"] = self._init()
        for m in spec.get("method", []) + spec.get("provided", []):
            if m.get("in_base", True):
                ns[m["name"]] = self._method(m)
        for p in spec.get("property", []):
            ns[p["name"]] = property(lambda s, b=self._behaviour(p["name"], p["base_default"]): b(s, None))
        self.base = abc.ABCMeta(spec["connector"]["base_class"], (abc.ABC,), ns)

    def _init(self) -> Callable:
        sig = _signature(self.spec["constructor"]["params"])
        sets = self.spec["constructor"]["base_sets"]

        def __init__(*args: Any, **kwargs: Any) -> None:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            values = {"_connector_metadata": None, "_vllm_config": a["vllm_config"],
                      "_kv_transfer_config": a["vllm_config"].kv_transfer_config,
                      "_kv_cache_config": a.get("kv_cache_config"), "_role": a["role"]}
            for attr in sets:
                setattr(a["self"], attr, values[attr])

        __init__.__signature__ = sig  # type: ignore[attr-defined]
        return __init__

    def _behaviour(self, name: str, tag: str) -> Callable:
        """What the base does by default, by the data's tag; called as behaviour(self, bound arguments)."""
        def transfer_results(s: Any, a: Any) -> Any:
            sending, recving = s.get_finished(a["finished_req_ids"])
            return self.types["KVConnectorTransferResults"](finished_sending=set(sending or ()),
                                                            finished_recving=set(recving or ()))

        def leading_exists(s: Any, a: Any) -> int:
            for i, key in enumerate(a["keys"]):
                if not s.exists(key):
                    return i
            return len(a["keys"])

        def not_implemented(s: Any, a: Any) -> Any:
            raise NotImplementedError(f"{name} (the engine's base class does not implement it)")

        def store_registered_pool(s: Any, a: Any) -> None:
            pools = getattr(s, "registered_pools", None) or {}
            pools[a["host_pool_name"]] = a["host_pool"]
            s.registered_pools = pools

        tags: Dict[str, Callable] = {
            "none": lambda s, a: None,
            "false": lambda s, a: False,
            "empty_tuple": lambda s, a: (),
            "empty_set": lambda s, a: set(),
            "pair_none": lambda s, a: (None, None),
            "not_freed": lambda s, a: (False, None),
            "store_metadata": lambda s, a: setattr(s, "_connector_metadata", a["connector_metadata"]),
            "clear_metadata": lambda s, a: setattr(s, "_connector_metadata", None),
            "has_metadata": lambda s, a: s._connector_metadata is not None,
            "get_metadata": lambda s, a: s._connector_metadata,
            "transfer_results_from_get_finished": transfer_results,
            "bind_block_pool_of_manager": lambda s, a: s.bind_gpu_block_pool(a["kv_cache_manager"].block_pool),
            "is_kv_producer": lambda s, a: bool(s._kv_transfer_config.is_kv_producer),
            "role": lambda s, a: s._role,
            "store_mem_pool_host": lambda s, a: setattr(s, "mem_pool_host", a["mem_pool_host"]),
            "store_registered_pool": store_registered_pool,
            "count_leading_exists": leading_exists,
            "raise_not_implemented": not_implemented,
        }
        if tag not in tags:
            raise ValueError(f"{self.spec['file']}: {name} has base_default {tag!r}, which the stand-in does not know")
        return tags[tag]

    def _method(self, m: Dict[str, Any], default: Optional[str] = None) -> Any:
        kind = m.get("kind", "method")
        sig = _signature(m.get("params", []), "cls" if kind == "classmethod" else "self")
        abstract = m.get("abstract", False)
        behaviour = self._behaviour(m["name"], m.get("base_default") or default or
                                    ("none" if abstract else "raise_not_implemented"))

        def method(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)  # the base refuses a call it would refuse
            bound.apply_defaults()
            return behaviour(args[0], bound.arguments)

        method.__name__ = m["name"]
        method.__signature__ = sig  # type: ignore[attr-defined]
        if m.get("none_means_ask_again"):
            method.__doc__ = ("How many tokens beyond num_computed_tokens the connector can load, and whether it loads "
                              "them asynchronously. If None, the connector needs more time: the scheduler asks "
                              "again later.")
        if kind == "classmethod":
            return classmethod(method)
        return abc.abstractmethod(method) if abstract else method

    def modules(self) -> Dict[str, Dict[str, Any]]:
        """{module name: attributes}: the engine's modules the adapter imports, with their parents."""
        spec = self.spec
        base_attrs: Dict[str, Any] = {spec["connector"]["base_class"]: self.base, **self.types, **self.mixins}
        if self.role is not None:
            base_attrs["KVConnectorRole"] = self.role
        if "SupportsHMA" in self.mixins:
            hma = self.mixins["SupportsHMA"]
            base_attrs["supports_hma"] = lambda c: issubclass(c, hma) if isinstance(c, type) else isinstance(c, hma)
        mods: Dict[str, Dict[str, Any]] = {spec["modules"]["base"]: base_attrs}
        if self.stats is not None:
            mods[spec["modules"]["stats"]] = {self.stats.__name__: self.stats}
        if spec["engine"] == "vllm":  # what the worker role imports besides the interface: TP rank 0 of 1
            mods["vllm.distributed.parallel_state"] = {"get_tensor_model_parallel_rank": lambda: 0}
        for name in list(mods):
            parts = name.split(".")
            for i in range(1, len(parts)):
                mods.setdefault(".".join(parts[:i]), {})
        return mods


class _StubTensor:
    """What the SGLang adapter asks of a torch tensor (this machine has no torch): view, numpy, cpu,
    element_size, over a NumPy array."""

    def __init__(self, array: np.ndarray, element_size: int = 1) -> None:
        self.array = array
        self._element_size = element_size

    def view(self, dtype: Any) -> "_StubTensor":
        return _StubTensor(self.array.view(np.uint8))

    def numpy(self) -> np.ndarray:
        return self.array

    def cpu(self) -> "_StubTensor":
        return self

    def element_size(self) -> int:
        return self._element_size


def _stub_torch() -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.Tensor = type("Tensor", (), {})  # no stub value is one: the adapter takes NumPy pages as plain arrays
    torch.uint8 = "uint8"
    return torch


@pytest.fixture
def built(monkeypatch):
    """build(spec) -> (the connector class built against the spec's stand-ins, the StandIn); modules restored
    afterwards."""
    def build(spec: Dict[str, Any]) -> Tuple[type, StandIn]:
        standin = StandIn(spec)
        for name, attrs in standin.modules().items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, module)
        if spec["engine"] == "sglang":
            monkeypatch.setitem(sys.modules, "torch", _stub_torch())
        adapter = spec["connector"]["module"]
        package, _, leaf = adapter.rpartition(".")
        monkeypatch.setattr(importlib.import_module(package), leaf, sys.modules.get(adapter), raising=False)
        monkeypatch.delitem(sys.modules, adapter, raising=False)
        module = importlib.import_module(adapter)
        monkeypatch.setitem(sys.modules, adapter, module)  # removed again (the original back) after the test
        return getattr(module, spec["connector"]["class"]), standin
    return build


# ---- the data files ----

def _entries(spec: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """(entry id, entry) for everything the engine calls: methods, mixin methods, properties."""
    out = [(m["name"], m) for m in spec.get("method", [])]
    out += [(f"{mixin['name']}.{m['name']}", dict(m, mixin=mixin["name"]))
            for mixin in spec.get("mixin", []) for m in mixin["method"]]
    out += [(p["name"], dict(p, kind="property")) for p in spec.get("property", [])]
    return out


def _cases(check: str, select: Callable[[Dict[str, Any]], bool] = lambda e: True) -> List[Any]:
    cases = []
    for spec in SPECS:
        for entry_id, entry in _entries(spec):
            if not select(entry):
                continue
            gap = KNOWN_GAPS.get((spec["engine"], entry_id, check))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            cases.append(pytest.param(spec, entry_id, entry, marks=marks, id=f"{spec['file']}-{entry_id}"))
    return cases


@pytest.mark.parametrize("spec", SPECS, ids=[s["file"] for s in SPECS])
def test_each_data_file_is_complete_and_its_calls_bind_to_its_own_base(spec):
    """Every entry has what the checks need, its shapes parse, its defaults are known to the stand-in, and each
    call written down binds to the base's own signature (the data is consistent with itself)."""
    assert spec["engine"] in ("vllm", "sglang"), spec["file"]
    assert spec["version"] and spec["sources"] and spec["summary"], spec["file"]
    standin = StandIn(spec)  # raises for an unknown base_default
    named = dict(standin.types)
    if "SupportsHMA" in standin.mixins:
        named["SupportsHMA"] = standin.mixins["SupportsHMA"]
    for entry_id, e in _entries(spec):
        where = f"{_where(spec)} {entry_id}"
        assert e.get("returns"), f"{where}: no returns"
        assert e.get("called_from"), f"{where}: no called_from"
        shape_mismatch(e["returns"], object(), named)  # ValueError for a shape the grammar does not know
        if e.get("kind") != "property":
            assert e.get("since"), f"{where}: no since"
            sig = _signature(e.get("params", []), None)
            for call in e["calls"]:
                sig.bind(*range(call.get("positional", 0)), **{k: 0 for k in call.get("keywords", [])})
    sig = _signature(spec["constructor"]["params"], None)
    for call in spec["constructor"]["calls"]:
        sig.bind(*range(call["positional"]))
    assert _entries(spec), spec["file"]


# ---- the connector against each entry ----

def _own_definition(cls: type, name: str, standin: StandIn) -> bool:
    """Whether `name` comes from the connector's classes rather than the engine's base or mixins."""
    engine_classes = {standin.base, *standin.mixins.values()}
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass not in engine_classes
    return False


def _signature_differences(ours: inspect.Signature, theirs: Dict[str, Any], bound_first: bool) -> List[str]:
    """What keeps the engine's calls (theirs["calls"]) from binding to our signature, or our parameters from
    carrying the base's names in the base's order."""
    problems = []
    for call in theirs.get("calls", []):
        args = [object()] * call.get("positional", 0)
        kwargs = {k: object() for k in call.get("keywords", [])}
        try:
            ours.bind(*([] if bound_first else [object()]), *args, **kwargs)
        except TypeError as e:
            problems.append(f"the engine's call with {len(args)} positional argument(s)"
                            f"{' and keywords ' + str(sorted(kwargs)) if kwargs else ''} does not bind to "
                            f"{ours}: {e}")
    positional = [p for p in ours.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][0 if bound_first else 1:]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in ours.parameters.values())
    base_positional = [p for p in theirs.get("params", []) if p.get("kind") is None]
    for i, p in enumerate(base_positional):
        if i < len(positional) and positional[i].name != p["name"]:
            problems.append(f"parameter {i + 1} is {positional[i].name!r}; the engine's base names it {p['name']!r}")
        elif i >= len(positional) and not var_kw and not any(q.kind == q.VAR_POSITIONAL
                                                            for q in ours.parameters.values()):
            problems.append(f"has no parameter {p['name']!r} (the base's parameter {i + 1})")
    for p in theirs.get("params", []):
        if p.get("kind") == "var_keyword" and not var_kw:
            problems.append(f"takes no **{p['name']} (the base passes extra keywords through it)")
    return problems


@pytest.mark.parametrize("spec,entry_id,entry", _cases("entry"))
def test_the_connector_has_each_entry_the_engine_calls(built, spec, entry_id, entry):
    cls, standin = built(spec)
    where = f"{cls.__name__}.{entry['name']} against {_where(spec)}"
    problems: List[str] = []
    if "mixin" in entry and not issubclass(cls, standin.mixins[entry["mixin"]]):
        problems.append(f"{cls.__name__} is not a {entry['mixin']} "
                        f"({next(m for m in spec['mixin'] if m['name'] == entry['mixin']).get('why', '')})")
    static = inspect.getattr_static(cls, entry["name"], None)
    kind = entry.get("kind", "method")
    if static is None:
        problems.append("is missing")
    elif kind == "property":
        if not isinstance(static, property):
            problems.append(f"is a {type(static).__name__}; the engine reads it as a property")
    else:
        if kind == "classmethod" and not isinstance(static, classmethod):
            problems.append(f"is a {type(static).__name__}; the engine calls it on the class (classmethod)")
        if kind == "method" and isinstance(static, (classmethod, staticmethod)):
            problems.append(f"is a {type(static).__name__}; the engine calls it on an instance")
        if not callable(getattr(cls, entry["name"])):
            problems.append("is not callable")
        else:
            ours = inspect.signature(getattr(cls, entry["name"]))
            problems += _signature_differences(ours, entry, bound_first=(kind == "classmethod"))
    if entry.get("abstract") and entry["name"] in getattr(cls, "__abstractmethods__", ()):
        problems.append("is abstract in the engine's base and not implemented")
    if entry.get("must_override") and not _own_definition(cls, entry["name"], standin):
        refuse = entry.get("or_refused_by")
        if not (refuse and _own_definition(cls, refuse, standin)):
            problems.append(f"is the base's default ({entry.get('base_default')}): {entry.get('why', '')}"
                            + (f"; nor is {refuse} overridden to refuse the case" if refuse else ""))
    assert not problems, f"{where}: " + "; ".join(problems) + f" [engine call site: {entry['called_from']}]"


@pytest.mark.parametrize("spec", SPECS, ids=[s["file"] for s in SPECS])
def test_the_engine_can_build_the_connector(built, spec):
    """The class the engine's factory or loader gets: a subclass of its base with nothing abstract left, whose
    constructor takes the engine's call."""
    cls, standin = built(spec)
    assert issubclass(cls, standin.base), f"{cls.__name__} is not a {standin.base.__name__} ({_where(spec)})"
    assert not getattr(cls, "__abstractmethods__", None), \
        f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract against {_where(spec)}"
    problems = _signature_differences(inspect.signature(cls.__init__), spec["constructor"], bound_first=False)
    assert not problems, f"{cls.__name__}.__init__ against {_where(spec)}: " + "; ".join(problems)


VLLM_SPECS = [s for s in SPECS if s["engine"] == "vllm"]
SGLANG_SPECS = [s for s in SPECS if s["engine"] == "sglang"]


@pytest.mark.parametrize("spec", VLLM_SPECS, ids=[s["file"] for s in VLLM_SPECS])
def test_the_connector_stats_and_metadata_are_what_vllm_aggregates_and_sends(built, spec):
    cls, standin = built(spec)
    module = sys.modules[spec["connector"]["module"]]
    stats_cls, meta_cls = module.FlexKVdConnectorStats, module.FlexKVdConnectorMetadata
    assert issubclass(meta_cls, standin.metadata), \
        f"FlexKVdConnectorMetadata is not a KVConnectorMetadata ({_where(spec)})"
    assert stats_cls is not None and issubclass(stats_cls, standin.stats), \
        f"FlexKVdConnectorStats is not a {spec['stats']['class']} ({_where(spec)})"
    problems = []
    for m in spec["stats"]["method"]:
        if m.get("must_override") and m["name"] not in {n for k in stats_cls.__mro__[:-1] if k is not standin.stats
                                                         for n in k.__dict__}:
            problems.append(f"{m['name']} is the base's (which raises NotImplementedError)")
        problems += [f"{m['name']}: {p}" for p in
                     _signature_differences(inspect.signature(getattr(stats_cls, m["name"])), m, bound_first=False)]
    assert not problems, f"FlexKVdConnectorStats against {_where(spec)}: " + "; ".join(problems)
    a = cls.build_kv_connector_stats({"lookups": 2, "stored_blocks": 4})
    b = pickle.loads(pickle.dumps(cls.build_kv_connector_stats({"lookups": 1})))  # sent from a worker process
    answers = {"reduce": a.reduce(), "is_empty": a.is_empty(), "aggregate": a.aggregate(b)}
    answers["reset"] = b.reset()
    named = dict(standin.types)
    for m in spec["stats"]["method"]:
        why = shape_mismatch(m["returns"], answers[m["name"]], named)
        assert why is None, f"FlexKVdConnectorStats.{m['name']} against {_where(spec)}: {why}"
    assert a.reduce() == {"lookups": 3, "stored_blocks": 4} and b.is_empty()


# ---- the calls in the engine's order, against a real flexkvd ----

def _vllm_config(socket: str, load_mode: Optional[str] = None) -> Any:
    class BF16:
        itemsize = 2

        def __str__(self) -> str:
            return "torch.bfloat16"

    model = NS_(model="pytest-llama", revision=None, dtype=BF16(), use_mla=False, get_num_layers=lambda p: 2,
                get_num_kv_heads=lambda p: 2, get_head_size=lambda: 64)
    return NS_(model_config=model, cache_config=NS_(block_size=BS, cache_dtype="auto"),
               parallel_config=NS_(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
               kv_transfer_config=NS_(kv_connector="FlexKVdConnector", kv_role="kv_both", is_kv_producer=True,
                                      kv_connector_module_path="flexkvd.integrations.vllm",
                                      kv_connector_extra_config=dict({"socket": socket}, **(
                                          {"load_mode": load_mode} if load_mode else {})),
                                      kv_load_failure_policy="recompute"))


class FullAttentionSpec:  # vLLM's spec class is told by its name (flexkvd.integrations.vllm.describe_vllm_groups)
    block_size, num_kv_heads, head_size, dtype = BS, 2, 64, NS_(itemsize=2)


def _one_group_kv_cache_config() -> Any:
    """kv_cache_config of the model _vllm_config describes: one full-attention group of its 2 layers."""
    return NS_(kv_cache_groups=[NS_(kv_cache_spec=FullAttentionSpec(),
                                    layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(2)])])


def _request(request_id: str, tokens: List[int]) -> Any:
    return NS_(request_id=request_id, all_token_ids=tokens, prompt_token_ids=tokens, num_tokens=len(tokens),
               num_prompt_tokens=len(tokens), lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None,
               num_computed_tokens=len(tokens), num_in_flight_tokens=0, num_preemptions=0)


# Engine calls the flow below does not make, and why (their signatures are checked above).
VLLM_NOT_DRIVEN = {
    "register_kv_caches": "needs CUDA KV tensors; test_vllm_adapter.py drives the host-KV registration",
    "register_cross_layers_kv_cache": "the engine calls it only when prefer_cross_layer_blocks is True",
    "get_finished": "where the version has get_transfer_results, the engine calls that and the base calls this",
    "bind_gpu_block_pool": "where the version has bind_kv_cache_manager, the base calls this from it",
    "request_finished": "a SupportsHMA connector gets request_finished_all_groups instead",
    "SupportsHMA.request_finished_all_groups": "the engine calls it only on a SupportsHMA connector",
}


class _Recorder:
    """Calls an engine method where the data has it (the engine version calls it) and keeps what it answered."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.entries = {name: e for name, e in _entries(spec)}
        self.entries.update({f"stats.{m['name']}": m for m in spec.get("stats", {}).get("method", [])})
        self.answers: Dict[str, List[Any]] = {}

    def has(self, name: str) -> bool:
        return name in self.entries

    def __call__(self, name: str, target: Any, *args: Any) -> Any:
        if name not in self.entries:
            return None
        value = getattr(target, name.rpartition(".")[2])
        if self.entries[name].get("kind") != "property":
            value = value(*args)
        self.answers.setdefault(name, []).append(value)
        return value

    def check(self, where: str, named: Dict[str, type], not_driven: Dict[str, str]) -> None:
        problems = []
        for name, values in self.answers.items():
            for value in values:
                why = shape_mismatch(self.entries[name]["returns"], value, named)
                if why is not None:
                    problems.append(f"{name} answered {why} (the engine expects {self.entries[name]['returns']})")
        for name in self.entries:
            if name not in self.answers and name not in not_driven and not name.startswith("stats."):
                problems.append(f"{name} is an engine call the flow does not make: drive it here or say why not in "
                                f"the not-driven list")
        assert not problems, f"{where}: " + "; ".join(problems)


@pytest.mark.parametrize("load_mode", ["whole", "layerwise"])
@pytest.mark.parametrize("spec", VLLM_SPECS, ids=[s["file"] for s in VLLM_SPECS])
def test_vllm_calls_in_the_engine_order_answer_with_the_engine_shapes(built, daemon, spec, load_mode):
    """One request stored and a second loading it, driven through every call of this vLLM version in the order
    Scheduler.schedule / the model runner's KV connector step / Scheduler.update_from_output make them, each
    answer checked against the shape the engine reads. A whole load is asynchronous (the request waits for
    finished_recving); a layer-wise one runs in the step that computes the request (never reported received)."""
    cls, standin = built(spec)
    call = _Recorder(spec)
    config = _vllm_config(daemon.socket, load_mode)
    layerwise = load_mode == "layerwise"
    nargs = spec["constructor"]["calls"][0]["positional"]
    sched = cls(*(config, standin.role.SCHEDULER, _one_group_kv_cache_config())[:nargs])
    worker = cls(*(config, standin.role.WORKER, _one_group_kv_cache_config())[:nargs])
    worker._worker.create_host_kv(16)  # no GPU here: the worker's KV is host KV (test_vllm_adapter.py does the same)
    # Where the version takes None ("ask again later"), a lookup must not block the scheduler's step; where it does
    # not, None would be read as a number.
    takes_none = bool(call.entries["get_num_new_matched_tokens"].get("none_means_ask_again"))
    assert sched._scheduler.may_defer == takes_none, \
        f"the scheduler connector {'does not answer' if takes_none else 'answers'} None (not yet) against " \
        f"{_where(spec)}, whose get_num_new_matched_tokens {'takes' if takes_none else 'does not take'} it"
    engine = HostKvEngine(worker._worker, 16)
    hma = "SupportsHMA" in standin.mixins and isinstance(sched, standin.mixins["SupportsHMA"])
    layer = "model.layers.0.self_attn.attn"
    tokens = prompt(41, 4 * BS + 5)
    try:
        # engine start
        call("bind_kv_cache_manager", sched, NS_(block_pool=NS_()))
        if not call.has("bind_kv_cache_manager"):
            call("bind_gpu_block_pool", sched, NS_())
        call("set_eagle_prefix_cache_hashing", sched, False)
        call("set_eagle_prefix_cache_hashing", worker, False)
        call("set_host_xfer_buffer_ops", worker, lambda *a: None)
        call("get_handshake_metadata", worker)
        call("set_xfer_handshake_metadata", sched, {})
        call("set_xfer_handshake_metadata_pp_aware", sched, {})
        call("get_mem_pool_context", worker)
        call("get_finished_count", sched)
        for name in ("role", "prefer_cross_layer_blocks", "supports_eagle_prefix_cache_hashing",
                     "requires_kv_delivery", "supports_divergent_local_hybrid_hits"):
            call(name, sched)
        for name, args in (("get_required_kvcache_layout", (config,)),
                           ("requires_piecewise_for_cudagraph", (config.kv_transfer_config.kv_connector_extra_config,)),
                           ("build_kv_connector_stats", ({"lookups": 1},)),
                           ("build_prom_metrics", (config, {}, ["model_name"], {0: ["pytest-llama"]}))):
            call(name, cls, *args)

        def worker_step(meta: Any, finished: set) -> Tuple[Any, Any]:
            """KVConnectorModelRunnerMixin's step: bind, load, the forward's layer calls, save, report."""
            call("bind_connector_metadata", worker, pickle.loads(pickle.dumps(meta)))  # travels to the workers
            params = {p["name"] for p in call.entries.get("handle_preemptions", {}).get("params", [])}
            call("handle_preemptions", worker, set() if "preempted_req_ids" in params else meta)
            call("start_load_kv", worker, None)
            call("wait_for_layer_load", worker, layer)
            call("save_kv_layer", worker, layer, None, None)
            call("wait_for_save", worker)
            call("finish_forward", worker)
            worker._worker.wait_all()  # this test's determinism: the engine instead hears of them in later steps
            if call.has("get_transfer_results"):
                results = call("get_transfer_results", worker, finished)
                done = (results.finished_sending or None, results.finished_recving or None)
            else:
                done = call("get_finished", worker, finished)
            errors = call("get_block_ids_with_load_errors", worker)
            call("get_kv_connector_stats", worker)
            call("get_kv_connector_kv_cache_events", worker)
            call("build_connector_worker_meta", worker)
            call("has_connector_metadata", worker)
            call("clear_connector_metadata", worker)
            call("update_connector_output", sched, NS_(finished_sending=done[0], finished_recving=done[1],
                                                       invalid_block_ids=errors, failed_recving=set(),
                                                       kv_connector_stats=None, kv_cache_events=None,
                                                       kv_connector_worker_meta=None))
            call("get_kv_connector_stats", sched)
            call("take_events", sched)
            return done

        # request 1: a miss, prefilled into blocks 0-4 (the engine writes KV of its 4 full blocks), then finished
        r1 = _request("r1", tokens)
        call("on_new_request", sched, r1)
        hit = (None, False)
        deadline = time.monotonic() + 10
        while hit[0] is None and time.monotonic() < deadline:  # None: asked again next step
            hit = call("get_num_new_matched_tokens", sched, r1, 0)
            time.sleep(0.002 if hit[0] is None else 0)
        assert hit == (0, False), f"a first lookup of {tokens[:3]}... answered {hit} ({_where(spec)})"
        call("update_state_after_alloc", sched, r1, NS_(get_block_ids=lambda *a, **k: ([0, 1, 2, 3, 4],)), 0)
        call("has_pending_push_work", sched)
        call("has_pending_block_frees", sched)
        call("can_load_prefix_replay_checkpoint", sched, r1, 0, 0)
        engine.compute(flexkvd.block_keys(NS, tokens, BS), [0, 1, 2, 3])
        if hma:
            finished = call("SupportsHMA.request_finished_all_groups", sched, r1, ([0, 1, 2, 3, 4],))
        else:
            finished = call("request_finished", sched, r1, [0, 1, 2, 3, 4])
        assert finished[0] is True, f"the finished request's store was not taken: {finished} ({_where(spec)})"
        call("register_finished_partial_tail", sched, r1, ([0, 1, 2, 3, 4],), [])
        meta = call("build_connector_meta", sched, NS_(preempted_req_ids=set(), finished_req_ids={"r1"},
                                                       scheduled_new_reqs=[], num_scheduled_tokens={}))
        assert worker_step(meta, {"r1"})[0] == {"r1"}

        # request 2: the same prompt, a hit loaded asynchronously into blocks 8-12
        r2 = _request("r2", tokens)
        call("on_new_request", sched, r2)
        hit = (None, False)
        deadline = time.monotonic() + 10
        while hit[0] is None and time.monotonic() < deadline:
            hit = call("get_num_new_matched_tokens", sched, r2, 0)
            time.sleep(0.002 if hit[0] is None else 0)
        assert hit == (4 * BS, not layerwise), f"the stored prefix was not found: {hit} ({_where(spec)})"
        call("update_state_after_alloc", sched, r2, NS_(get_block_ids=lambda *a, **k: ([8, 9, 10, 11, 12],)),
             4 * BS)
        meta = call("build_connector_meta", sched, NS_(preempted_req_ids=set(), finished_req_ids=set(),
                                                       scheduled_new_reqs=[], num_scheduled_tokens={}))
        assert worker_step(meta, set())[1] == (None if layerwise else {"r2"})
        assert engine.holds(flexkvd.block_keys(NS, tokens, BS), [8, 9, 10, 11])
        call("consume_prefix_replay_checkpoint", sched, r2, 4 * BS)
        call("reset_capture_state", worker)
        call("reset_cache", sched)
    finally:
        call("shutdown", sched)
        call("shutdown", worker)
        engine.release()
    named = dict(standin.types)
    call.check(f"FlexKVdConnector against {_where(spec)}", named, VLLM_NOT_DRIVEN)


@pytest.mark.parametrize("spec,entry_id,entry", _cases("value", lambda e: "expect" in e))
def test_values_the_engine_documents_for_a_connector_like_this_one(built, daemon, spec, entry_id, entry):
    cls, standin = built(spec)
    config = _vllm_config(daemon.socket)
    sched = cls(config, standin.role.SCHEDULER, _one_group_kv_cache_config())
    try:
        value = getattr(sched, entry["name"])
    finally:
        sched.shutdown()
    assert value == _literal(entry["expect"]), \
        f"FlexKVdConnector.{entry['name']} is {value!r} against {_where(spec)}; expected {entry['expect']}: " \
        f"{entry.get('why', '')}"


# ---- SGLang ----

LAYERS, HEADS, HEAD_BYTES, PAGE, POOL_PAGES = 2, 2, 128, 16, 8

SGLANG_NOT_DRIVEN = {
    "register_mem_host_pool_v2": "needs a hybrid host pool (Mamba/SWA sidecars)",
    "batch_exists_v2": "only reached with a hybrid host pool",
    "batch_get_v2": "only reached with a hybrid host pool",
    "batch_set_v2": "only reached with a hybrid host pool",
}


@pytest.mark.parametrize("spec", SGLANG_SPECS, ids=[s["file"] for s in SGLANG_SPECS])
def test_sglang_calls_in_the_controller_order_answer_with_the_engine_shapes(built, daemon, spec):
    """The backend built as SGLang's dynamic loader builds it, registered with an MHA host pool, then the backup,
    hit query and prefetch calls of HiCacheController (v1 zero copy) and the generic get/set path, each answer
    checked against the shape the controller reads."""
    cls, standin = built(spec)
    call = _Recorder(spec)
    named = dict(standin.types)
    extra = {"backend_name": "flexkvd", "module_path": spec["connector"]["module"],
             "class_name": spec["connector"]["class"], "interface_v1": 1, "socket": daemon.socket,
             "namespace": "sglang/conformance", "staging_pages": 4, "op_timeout_s": 10.0}
    config = standin.types["HiCacheStorageConfig"](
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=True, is_page_first_layout=False, model_name="pytest-model", extra_config=extra)
    storage = cls(*(config, {})[:spec["constructor"]["calls"][0]["positional"]])
    kv = np.zeros((2, LAYERS, POOL_PAGES * PAGE, HEADS, HEAD_BYTES), dtype=np.uint8)  # layer_first, bf16 heads
    pool = type("MHATokenToKVPoolHost", (), {})()
    pool.kv_buffer, pool.layout, pool.page_size, pool.dtype = _StubTensor(kv, element_size=2), "layer_first", PAGE, None
    pages = [0, 1, 2]
    kv[:, :, :3 * PAGE] = np.random.default_rng(5).integers(1, 256, size=kv[:, :, :3 * PAGE].shape, dtype=np.uint8)
    keys = [f"{i:064x}" for i in (11, 12, 13)]
    indices = _StubTensor(np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages]))
    info = standin.types["HiCacheStorageExtraInfo"](prefix_keys=None)
    try:
        call("register_mem_pool_host", storage, pool)
        written = call("batch_set_v1", storage, keys, indices, info)
        assert written == [True, True, True], f"backup answered {written} ({_where(spec)})"
        assert call("batch_exists", storage, keys + ["f" * 64], info) == 3
        into = _StubTensor(np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in (4, 5, 6)]))
        assert call("batch_get_v1", storage, keys, into, info) == [True, True, True]
        assert np.array_equal(kv[:, :, 4 * PAGE:7 * PAGE], kv[:, :, :3 * PAGE])
        assert call("exists", storage, keys[0]) is True
        page_bytes = kv[:, :, :PAGE].size
        flat = np.random.default_rng(6).integers(1, 256, size=page_bytes, dtype=np.uint8)
        assert call("set", storage, "e" * 64, flat) is True
        target = np.zeros(page_bytes, dtype=np.uint8)
        call("get", storage, "e" * 64, target)
        assert np.array_equal(target, flat)
        assert call("batch_set", storage, ["d" * 64], [flat]) is True
        got = call("batch_get", storage, ["d" * 64, "c" * 64], [np.zeros(page_bytes, np.uint8) for _ in "dc"])
        assert got[1] is None and np.array_equal(got[0], flat)
        call("get_stats", storage)
        call("clear", storage)
    finally:
        call("close", storage)
    call.check(f"FlexKVdStorage against {_where(spec)}", named, SGLANG_NOT_DRIVEN)

"""The namespace as a cell found it: a fingerprint per name, taken before every cell.

``NamespaceSnapshot.take`` records, per name, the object's id and a cheap fingerprint of its size: a
container's length, an optimizer's number of states, a module's first parameter's storage and
gradient, a tensor's gradient, an object's attributes (ids and lengths, one level deep); and which
references IPython kept. No object is walked and no reference is kept, so nothing is kept alive and a
cell costs microseconds per name. ``left.judge_namespace`` compares the namespace after the cell with it.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice, repeat
from typing import Any

from ..collector import collector_paused
from .holders import Reference
from .probe import TensorProbe, default_probe, grad_of
from .walk import (
    ATOM_TYPES,
    ATOMS,
    EXCEPTION_CODE,
    FRAME_CODE,
    FUNCTION_CODE,
    MACHINERY_CODE,
    MAPPING_CODE,
    MODULE_CODE,
    OBJECT_CODE,
    OPAQUE_CODE,
    OPTIMIZER_CODE,
    SEQUENCE_CODE,
    SET_CODE,
    TENSOR_CODE,
    TRACEBACK_CODE,
    memo_by_type,
    type_code,
)

_ATTRIBUTES_FINGERPRINTED = 64

Fingerprint = tuple[Any, ...]
"""``(id, ...)``: what follows the id depends on the kind of object (a length and its children's, a module's
first parameter's storage and gradient, a tensor's gradient, attributes), compared field by field."""


def sized(value: Any) -> int:
    try:
        return len(value)
    except Exception:
        return -1


_CONTAINER_CODES = frozenset({MAPPING_CODE, SEQUENCE_CODE, SET_CODE})
# Why 64: a container's or object's first 64 children are fingerprinted (ids, and lengths of the
# containers among them) so that growth one level down is seen; past 64, a name is a big collection
# whose growth shows in its own length, and reading more would cost every cell (the snapshot is taken
# before each one) for what a notebook rarely does.
CHILDREN_FINGERPRINTED = 64


@memo_by_type
def grows_in_place(kind: type) -> bool:
    """Children whose length the fingerprint records: lists, tuples, dicts and deques (and subclasses:
    ``defaultdict(list)``), whose growth inside an unchanged container is what a leak looks like."""
    return issubclass(kind, (list, tuple, dict, deque))


# Types whose values the fingerprint records no length of (tensors, numbers, plain objects): where a
# container's children or an object's attributes are all of these, which is most of a namespace, its
# fingerprint is made by C loops (``issuperset``, ``zip``, ``map(id, ...)``) with no Python per child.
_LENGTHLESS: set[type] = set(ATOMS)
_CONTAINER_TYPES = (dict, list, tuple, deque, set, frozenset)


def _learn_lengthless(children: Iterable[object]) -> None:
    if len(_LENGTHLESS) >= 8192:  # classes redefined in a loop: start again
        _LENGTHLESS.clear()
        _LENGTHLESS.update(ATOMS)
    for kind in set(map(type, children)).difference(_LENGTHLESS):  # the types not met before only
        if not issubclass(kind, _CONTAINER_TYPES):
            _LENGTHLESS.add(kind)


def _inner_sizes(children: Iterable[Any], count: int) -> tuple[tuple[int, int], ...]:
    """``(id, length)`` of the lists, dicts and deques among the first ``CHILDREN_FINGERPRINTED``
    ``children`` (``count`` of them): what lets ``history['losses'].append(...)`` be seen in ``history``."""
    first = list(islice(children, CHILDREN_FINGERPRINTED)) if count > CHILDREN_FINGERPRINTED else list(children)
    if _LENGTHLESS.issuperset(map(type, first)):
        return ()
    _learn_lengthless(first)
    grows = grows_in_place
    return tuple([(id(child), len(child)) for child in first if grows(type(child))])


_PLAIN_CODES = frozenset({OPAQUE_CODE, MACHINERY_CODE, EXCEPTION_CODE, TRACEBACK_CODE, FRAME_CODE, FUNCTION_CODE})
_PLAIN = -1  # a code of our own: atoms and the plain codes, whose fingerprint is their id alone
_DUCK_TENSOR = -2  # and another: tensor types without PyTorch's attributes (fakes, tensor-likes)


def fingerprint(value: Any, probe: TensorProbe, codes: dict[type, int] | None = None) -> Fingerprint:
    """The id and what can grow in place without the id changing; cheap (one type lookup), never raises.
    ``codes`` caches type codes across one namespace's names."""
    ident = id(value)
    kind = type(value)
    if kind in ATOM_TYPES:
        return (ident,)
    code = codes.get(kind) if codes is not None else None
    if code is None:
        code = type_code(kind, probe)
        if codes is not None:
            codes[kind] = code
    try:
        if code == TENSOR_CODE:  # the commonest first
            return _tensor_fingerprint(value)
        if code in _PLAIN_CODES:
            return (ident,)
        if code == SET_CODE:
            return (ident, len(value))
        if code == MAPPING_CODE:
            size = len(value)
            return (ident, size, _inner_sizes(value.values(), size))
        if code == SEQUENCE_CODE:
            size = len(value)
            return (ident, size, _inner_sizes(value, size))
        if code == MODULE_CODE:
            first = _first_parameter(value)
            if first is None:
                return (ident, None, None)
            return (ident, probe.device_storage(first), id(grad_of(first)))
        if code == OPTIMIZER_CODE:
            return (ident, sized(getattr(value, "state", ())))
        if code != OBJECT_CODE:
            return (ident,)
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            return (ident, _attribute_fingerprint(attributes, probe, codes if codes is not None else {}))
    except Exception:
        pass
    return (ident,)


def _attribute_fingerprint(
    attributes: dict[str, Any], probe: TensorProbe, codes: dict[type, int]
) -> tuple[tuple[str, int, int], ...]:
    """``(name, id, length or -1)`` of an object's first attributes; a length for containers only.

    Containers are told by type code (cached per type), not ``isinstance``: ``isinstance(tensor, list)``
    reads the tensor's ``__class__`` through PyTorch's attribute lookup, four times per attribute."""
    items = []
    for position, (name, attribute) in enumerate(attributes.items()):
        if position >= _ATTRIBUTES_FINGERPRINTED:
            break
        kind = type(attribute)
        code = codes.get(kind)
        if code is None:
            code = codes[kind] = _PLAIN if kind in ATOM_TYPES else type_code(kind, probe)
        items.append((name, id(attribute), len(attribute) if code in _CONTAINER_CODES else -1))
    return tuple(items)


def _first_parameter(module: Any, depth: int = 0) -> object:
    """``next(iter(module.parameters()))`` without its generators (a tenth of the cost): the module's
    own first parameter, else its first child's, depth first, as ``named_parameters`` orders them."""
    own = getattr(module, "_parameters", None)
    children = getattr(module, "_modules", None)
    if not isinstance(own, dict) or not isinstance(children, dict) or depth > 64:
        return next(iter(module.parameters()), None)
    for parameter in own.values():
        if parameter is not None:
            return parameter
    for child in children.values():
        if child is not None:
            found = _first_parameter(child, depth + 1)
            if found is not None:
                return found
    return None


def _tensor_fingerprint(value: Any) -> tuple[int, int]:
    try:  # grad_of's test, by plain attribute reads: a third of getattr's cost on a tensor
        grad = value.grad if value.is_leaf or value.retains_grad else None
    except Exception:  # fakes and tensor-likes without is_leaf or retains_grad
        grad = grad_of(value)
    return (id(value), id(grad))


@dataclass(frozen=True)
class NamespaceSnapshot:
    """The namespace as a cell found it: fingerprints by name, and IPython's references by name.

    ``base`` with ``changed`` laid over it (``None``: the name went), so that a snapshot kept from cell to
    cell (``tracked``) shares its ``base`` with the one before instead of copying every name."""

    base: Mapping[str, Fingerprint]
    references: frozenset[int]  # ids of what IPython kept
    changed: Mapping[str, Fingerprint | None] = field(default_factory=dict)

    @cached_property
    def names(self) -> Mapping[str, Fingerprint]:
        """The fingerprint of every name (made when first asked: after a cell that left enough to attribute)."""
        if not self.changed:
            return self.base
        merged = dict(self.base)
        for name, fingerprint in self.changed.items():
            if fingerprint is None:
                merged.pop(name, None)
            else:
                merged[name] = fingerprint
        return merged

    @classmethod
    def take(
        cls,
        namespace: Mapping[str, object],
        references: Iterable[Reference] = (),
        probe: TensorProbe | None = None,
    ) -> NamespaceSnapshot:
        probe = probe if probe is not None else default_probe()
        if probe is None:
            return cls({}, frozenset())
        with warnings.catch_warnings(), collector_paused():
            warnings.simplefilter("ignore")
            names = fingerprints(list(namespace.items()), probe)
        return cls(names, frozenset(id(reference.value) for reference in references))


def fingerprints(items: list[tuple[str, Any]], probe: TensorProbe) -> dict[str, Fingerprint]:
    """``fingerprint`` of every value, equal to it name by name, in one loop.

    Taken before every cell in every-cell mode, on cells that leave nothing as on the rare one that
    leaves enough to attribute, so a namespace of 10,000 names must cost little: the kinds that are
    most of a namespace (atoms, functions, modules, tensors, lists and dicts) are fingerprinted here
    without a function call of their own; the rarer ones go through ``fingerprint``.
    """
    codes: dict[type, int] = {}
    names: dict[str, Fingerprint] = {}
    lengthless = _LENGTHLESS.issuperset
    for name, value in items:
        kind = type(value)
        code = codes.get(kind)
        if code is None:
            code = _PLAIN if kind in ATOM_TYPES else type_code(kind, probe)
            if code == TENSOR_CODE and not all(hasattr(kind, name) for name in ("is_leaf", "retains_grad", "grad")):
                code = _DUCK_TENSOR  # read through grad_of: a failed attribute read costs more than getattr
            codes[kind] = _PLAIN if code in _PLAIN_CODES else code
            code = codes[kind]
        if code == _PLAIN:
            names[name] = (id(value),)
        elif code == TENSOR_CODE:
            try:  # _tensor_fingerprint, inline
                grad = value.grad if value.is_leaf or value.retains_grad else None
            except Exception:
                grad = grad_of(value)
            names[name] = (id(value), id(grad))
        elif code == _DUCK_TENSOR:
            names[name] = (id(value), id(grad_of(value)))
        elif code == SEQUENCE_CODE or code == MAPPING_CODE:
            try:  # fingerprint's, inline
                size = len(value)
                children = value.values() if code == MAPPING_CODE else value
                if size <= CHILDREN_FINGERPRINTED and lengthless(map(type, children)):
                    names[name] = (id(value), size, ())
                else:
                    names[name] = (id(value), size, _inner_sizes(children, size))
            except Exception:
                names[name] = fingerprint(value, probe, codes)
        elif code == OBJECT_CODE:
            attributes = getattr(value, "__dict__", None)
            if type(attributes) is dict and len(attributes) <= _ATTRIBUTES_FINGERPRINTED:
                values = attributes.values()
                if lengthless(map(type, values)):  # _attribute_fingerprint's, by C loops
                    names[name] = (id(value), tuple(zip(attributes, map(id, values), repeat(-1))))
                    continue
            names[name] = fingerprint(value, probe, codes)
        else:
            names[name] = fingerprint(value, probe, codes)
    return names

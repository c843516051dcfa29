"""Synchronized layers under ``torch.fx`` symbolic tracing: leaves, as torch's own batch-norm layers are.

``torch.fx``'s default tracer treats modules defined in ``torch.nn`` as leaves (one ``call_module`` node) and
traces through any other module's forward. A synchronized layer's forward branches on its input (checks,
empty batches, who to sync with), which a symbolic trace cannot follow. So a layer called with a ``Proxy``
records itself as one ``call_module`` node, whatever the tracer's ``is_leaf_module`` says: the traced graph
calls the layer, which synchronizes when the graph runs (``create_feature_extractor``, timm's feature graphs,
conv-BN fusers all see the same node as for ``nn.BatchNorm2d``). A converted batch-norm subclass is
recorded as the tracer records the subclass itself (see ``subclass.py``): :func:`traced_as_leaf` asks.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["is_proxy", "leaf_call", "traced_as_leaf"]


def is_proxy(value: object) -> bool:
    """Whether ``value`` is a ``torch.fx`` proxy (a symbolic trace is running)."""
    fx = sys.modules.get("torch.fx")  # no proxy exists before torch.fx is imported
    return fx is not None and isinstance(value, fx.Proxy)


def leaf_call(layer: nn.Module, input) -> object:
    """Record ``layer(input)`` as one ``call_module`` node of ``input``'s tracer and return its proxy."""
    tracer = input.tracer
    return tracer.create_proxy("call_module", tracer.path_of_module(layer), (input,), {})


def traced_as_leaf(input, layer: nn.Module, cls: type[nn.Module]) -> bool:
    """Whether ``input``'s tracer would record a ``cls`` module at ``layer``'s place as one ``call_module``
    node. Asked of a stand-in: a ``cls`` object holding ``layer``'s state (its tensors, children and
    attributes, shared), as tracers decide by class, module name or path (``is_leaf_module``)."""
    stand_in = cls.__new__(cls)
    stand_in.__dict__.update(layer.__dict__)
    tracer = input.tracer
    return tracer.is_leaf_module(stand_in, tracer.path_of_module(layer))

"""Calls are bound by torch's own signature, kept in the OpSpec, whatever object a name held
when patched (issue #16, item 1)."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.distributed_c10d as c10d

from commcheck.rank.install import binder
from commcheck.wire.ops import OPS


@pytest.mark.parametrize("spec", OPS, ids=lambda s: s.name)
def test_opspec_params_are_torchs_signature(spec):
    for name in (spec.name, *spec.aliases):
        assert tuple(inspect.signature(getattr(c10d, name)).parameters) == spec.params


def test_a_plain_shim_binds_like_torch():
    [spec] = [s for s in OPS if s.name == "broadcast"]

    def shim(*args, **kwargs):
        return args, kwargs

    bind = binder(shim, spec.params)
    assert bind(("t", 3), {"async_op": True}) == {"tensor": "t", "src": 3, "async_op": True}
    assert bind(("t",), {"group_src": 1}) == {"tensor": "t", "group_src": 1}
    assert bind(("t", 0, None, False, None, "extra"), {}) is None  # torch rejects it too
    assert bind(("t",), {"verbose": True}) is None  # the shim's own argument: not torch's
    own = binder(c10d.broadcast)  # without names: the function's signature, with defaults
    assert own(("t",), {})["async_op"] is False


def test_the_hot_paths_native_bind_binds_like_the_shim_binder():
    from commcheck.native import hot

    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    [spec] = [s for s in OPS if s.name == "broadcast"]

    def shim(*args, **kwargs):
        return args, kwargs

    python, native = binder(shim, spec.params), hot.module().bind
    allowed = frozenset(spec.params)
    for args, kwargs in ((("t", 3), {"async_op": True}), (("t",), {"group_src": 1}),
                         ((), {"tensor": "t", "src": 0}), (("t", 0, None, False, None), {}),
                         (("t", 0, None, False, None, "extra"), {}), (("t",), {"nope": 1})):
        assert native(spec.params, allowed, args, kwargs) == python(args, kwargs)
    assert native(spec.params, allowed, ("t",), {"nope": 1}) is None

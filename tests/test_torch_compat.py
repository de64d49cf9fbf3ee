"""Tier 2 (CPU torch): what planner.torch_compat's readers of torch's private attributes return.

Each reads one private name of torch (see the module's docstring); a torch release that renames or
changes one fails here first, by name, rather than as a wrong count somewhere in a plan.
"""

from __future__ import annotations

import datetime
import importlib
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from planner.torch_compat import export_logger_names, local_tensor, op_schema, own_tensor_tables, view_base  # noqa: E402


def test_view_base_is_the_tensor_whose_memory_a_view_holds() -> None:
    t = torch.zeros(4, 4)
    assert view_base(t) is None
    assert view_base(t.view(16)) is t
    assert view_base(t[1:].t()) is t  # a view of a view: the tensor that owns the memory
    meta = torch.empty(2, 3, device="meta")  # the estimator's tensors
    assert view_base(meta.view(6)) is meta


def test_op_schema_says_what_an_operator_writes_and_aliases() -> None:
    aten = torch.ops.aten
    add = op_schema(aten.add.Tensor)
    assert not add.is_mutable
    assert all(a.alias_info is None for a in (*add.arguments, *add.returns))
    assert op_schema(aten.add_.Tensor).is_mutable
    assert any(r.alias_info is not None for r in op_schema(aten.view.default).returns)


def test_own_tensor_tables_are_a_modules_own_dicts_and_writes_go_through() -> None:
    norm = nn.BatchNorm1d(3)
    params, buffers = own_tensor_tables(norm)
    assert set(params) == {"weight", "bias"}
    assert {"running_mean", "running_var"} <= set(buffers)
    original, meta = params["weight"], torch.empty(3, device="meta")
    params["weight"] = meta  # a plain tensor in a parameter's place, as the shape runs put one
    assert norm.weight is meta
    params["weight"] = original
    assert norm.weight is original
    assert own_tensor_tables(nn.Sequential(norm)) == ({}, {})  # a child's tensors are the child's


def test_export_logger_names_are_modules_of_this_torch() -> None:
    names = export_logger_names()
    assert {"torch._dynamo", "torch._export"} <= set(names)
    for name in names:  # a logger named after a module torch no longer has would silence nothing
        importlib.import_module(name)


def test_local_tensor_is_the_dtensors_own_part_not_an_alias() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(60))
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = torch.randn(4, requires_grad=True)
        dt = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        local = local_tensor(dt)
        assert local is local_tensor(dt)  # the same object on every call
        assert dt.to_local() is not local  # to_local's fresh alias (an autograd node) is not
        kept = weakref.ref(local)
        assert kept() is local  # lives as long as the DTensor
        assert local.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    finally:
        dist.destroy_process_group()

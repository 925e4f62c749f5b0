"""Issue 24 item 12 (paths): a runtime LoadAdapter reads only inside the adapter directories
the replica was started with — ``..``, a symlink out, an absolute path elsewhere, or no
directory configured at all are refused PERMISSION_DENIED naming the path."""

from __future__ import annotations

import asyncio
import os
import shutil

import grpc
import pytest

from kvfleet.errors import KvfleetError
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.replica import adapter_admin
from kvfleet.worker.replica.adapter_admin import AdapterAdmin
from kvfleet.worker.replica.adapter_catalog import adapter_roots
from kvfleet.worker.runner.lora.adapter import WEIGHTS_FILE, check_adapter
from kvfleet.worker.runner.model_config import load_model_config


@pytest.fixture
def layout(tmp_path, tiny_adapters):
    """``root/`` holding a copy of ``qv`` (the configured directory) and ``outside/`` a copy
    of ``all`` (not configured)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(tiny_adapters["qv"], root / "qv")
    shutil.copytree(tiny_adapters["all"], outside / "all")
    return root, outside


def _admin(tiny_llama_dir, roots) -> AdapterAdmin:
    res = AdapterResidency(None, {}, max_loras=1)
    return AdapterAdmin(res, load_model_config(tiny_llama_dir), 16, roots)


def _refused(admin: AdapterAdmin, path: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KvfleetError) as err:
        asyncio.run(admin.load("x", path))
    return err.value.code, str(err.value)


def test_a_path_inside_a_configured_directory_loads(tiny_llama_dir, layout) -> None:
    root, _ = layout
    admin = _admin(tiny_llama_dir, adapter_roots((), [str(root)]))
    assert asyncio.run(admin.load("qv", str(root / "qv")))
    assert "qv" in admin.residency.catalog
    admin.residency.close()


def test_paths_out_of_the_adapter_directories_are_permission_denied(tiny_llama_dir, layout) -> None:
    root, outside = layout
    admin = _admin(tiny_llama_dir, adapter_roots((), [str(root)]))
    (root / "escape").symlink_to(outside / "all", target_is_directory=True)
    (root / "mixed").mkdir()
    os.symlink(outside / "all" / "adapter_config.json", root / "mixed" / "adapter_config.json")
    shutil.copyfile(outside / "all" / WEIGHTS_FILE, root / "mixed" / WEIGHTS_FILE)
    for path in (str(outside / "all"),                 # absolute, elsewhere
                 f"{root}/qv/../../outside/all",        # '..'
                 f"{root}/qv/..",                       # '..' even when it stays inside
                 str(root / "escape"),                  # a symlinked directory out
                 str(root / "mixed")):                  # a symlinked file out
        code, message = _refused(admin, path)
        assert code is grpc.StatusCode.PERMISSION_DENIED, (path, message)
        assert path in message
    assert admin.residency.catalog == {}
    code, message = _refused(admin, "qv")  # relative: where would it be?
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "absolute" in message
    admin.residency.close()


def test_no_configured_directory_refuses_every_runtime_load(tiny_llama_dir, layout) -> None:
    root, _ = layout
    admin = _admin(tiny_llama_dir, ())
    code, message = _refused(admin, str(root / "qv"))
    assert code is grpc.StatusCode.PERMISSION_DENIED and "--adapter-root" in message
    admin.residency.close()


def test_what_is_loaded_is_the_directory_that_was_checked(tiny_llama_dir, layout,
                                                          monkeypatch) -> None:
    # A symlink repointed out of the roots right after the check (a race the caller can run
    # against its own LoadAdapter) must not change what is read and served.
    root, outside = layout
    link = root / "current"
    link.symlink_to(root / "qv", target_is_directory=True)
    admin = _admin(tiny_llama_dir, adapter_roots((), [str(root)]))
    checked = adapter_admin.confine

    def confine_then_swap(path, roots):
        out = checked(path, roots)
        link.unlink()
        link.symlink_to(outside / "all", target_is_directory=True)
        return out

    monkeypatch.setattr(adapter_admin, "confine", confine_then_swap)
    revision = asyncio.run(admin.load("cur", str(link)))
    spec = admin.residency.catalog["cur"]
    assert spec.path == str((root / "qv").resolve())
    assert revision == check_adapter("qv", root / "qv", admin.config, 16).revision
    admin.residency.close()


def test_a_file_symlink_moved_while_it_was_read_is_refused(tiny_llama_dir, layout,
                                                           monkeypatch) -> None:
    root, outside = layout
    (root / "mix").mkdir()
    config = root / "mix" / "adapter_config.json"
    config.symlink_to(root / "qv" / "adapter_config.json")
    shutil.copyfile(root / "qv" / WEIGHTS_FILE, root / "mix" / WEIGHTS_FILE)
    admin = _admin(tiny_llama_dir, adapter_roots((), [str(root)]))

    def check_then_swap(*args):
        spec = check_adapter(*args)
        config.unlink()
        config.symlink_to(outside / "all" / "adapter_config.json")
        return spec

    monkeypatch.setattr(adapter_admin, "check_adapter", check_then_swap)
    code, message = _refused(admin, str(root / "mix"))
    assert code is grpc.StatusCode.PERMISSION_DENIED and "changed while" in message
    assert admin.residency.catalog == {}
    admin.residency.close()

"""The attention-backend registry: library backends are lazy ``module:Class`` entries, imported
only when asked for, and one that cannot be imported is reported unavailable with the reason."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spaceserve.models import BackendUnavailable, available_backends, get_backend
from spaceserve.models.attention import backends as attention_backends

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_models_does_not_import_the_library_backends():
    code = ("import sys, spaceserve.models; "
            "print('spaceserve.models.attention.library' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[-1] == "False"


def test_lazy_entry_is_loaded_when_asked_for(monkeypatch):
    path = "spaceserve.models.attention.backends:TritonBackend"
    monkeypatch.setitem(attention_backends._REGISTRY, "lazy_triton", path)
    assert attention_backends._REGISTRY["lazy_triton"] == path
    assert "lazy_triton" in available_backends()
    assert isinstance(get_backend("lazy_triton"), attention_backends.TritonBackend)
    assert attention_backends._REGISTRY["lazy_triton"] is attention_backends.TritonBackend


@pytest.mark.parametrize("path", ["spaceserve.models.no_such_module:Backend",
                                  "spaceserve.models.attention.backends:NoSuchBackend"])
def test_lazy_entry_that_cannot_be_imported_is_unavailable(monkeypatch, path):
    monkeypatch.setitem(attention_backends._REGISTRY, "broken", path)
    assert "broken" not in available_backends()
    with pytest.raises(BackendUnavailable, match=f"'broken' is unavailable: {path} is not "
                                                 "importable"):
        get_backend("broken")


def test_register_backend_refuses_a_lazy_path_without_name_or_class():
    with pytest.raises(ValueError, match="module:Class"):
        attention_backends.register_backend("spaceserve.models.attention.library")
    with pytest.raises(ValueError, match="module:Class"):
        attention_backends.register_backend("spaceserve.models.attention.library:X")

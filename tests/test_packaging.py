"""The package as pip users get it: extras named after what they enable, every missing optional library's
error naming its pip command, complete metadata, ``py.typed``, and an sdist that holds the tests."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_extras_are_named_after_what_they_enable_and_all_holds_them() -> None:
    from torchckpt._optional import EXTRAS

    extras = {name: {_name(r) for r in reqs} for name, reqs in PROJECT["project"]["optional-dependencies"].items()}
    assert {"hf", "train", "lightning", "plot", "remote", "all", "dev"} <= set(extras)
    for module, extra in EXTRAS.items():  # the library each error names is in the extra it names
        assert module in extras[extra], (module, extra)
    assert set().union(*(reqs for name, reqs in extras.items() if name not in ("all", "dev"))) == extras["all"]
    assert extras["all"] <= extras["dev"]


def test_metadata_is_complete_and_the_package_is_typed() -> None:
    project = PROJECT["project"]
    assert project["readme"] == "README.md" and project["license"] == "Apache-2.0" and project["keywords"]
    assert "Typing :: Typed" in project["classifiers"] and any("3.10" in c for c in project["classifiers"])
    assert project["requires-python"] == ">=3.10" and project["scripts"]["torchckpt"] == "torchckpt.cli.main:main"
    assert (ROOT / "src" / "torchckpt" / "py.typed").is_file()
    assert PROJECT["tool"]["setuptools"]["package-data"]["torchckpt"] == ["py.typed"]
    manifest = (ROOT / "MANIFEST.in").read_text().split()
    assert all(f"graft {folder}" in " ".join(manifest) or folder in manifest for folder in ("tests", "docs", "bench"))


def _fresh_import_without(monkeypatch: pytest.MonkeyPatch, blocked: str, module: str) -> ImportError:
    for name in [name for name in sys.modules if name.startswith(blocked + ".")] + [blocked]:
        monkeypatch.setitem(sys.modules, name, None)  # `import blocked(.anything)` raises ImportError, even when an
        # earlier test in this process imported its submodules (which `from blocked.sub import x` finds first)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as error:
        importlib.import_module(module)
    return error.value


@pytest.mark.parametrize(("blocked", "module", "command"), [
    ("transformers", "torchckpt.integrations.hf_trainer", "pip install 'torchckpt[hf]'"),
    ("lightning", "torchckpt.integrations.lightning", "pip install 'torchckpt[lightning]'"),
])
def test_a_missing_integration_library_names_its_pip_command(monkeypatch: pytest.MonkeyPatch, blocked: str,
                                                             module: str, command: str) -> None:
    assert command in str(_fresh_import_without(monkeypatch, blocked, module))


def test_every_other_missing_optional_library_names_its_pip_command(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    import numpy as np

    from torchckpt.models import BatchShape, load_model
    from torchckpt.planner.frontier import Frontier
    from torchckpt.state import CheckpointWriteError
    from torchckpt.state.storage.remote import FsspecStorage
    from torchckpt.train.data import ByteChunks, make_loader

    for blocked in ("transformers", "matplotlib", "fsspec", "torchdata", "torchdata.stateful_dataloader"):
        monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(ImportError, match=re.escape("pip install 'torchckpt[hf]'")):
        load_model("hf-llama", BatchShape(batch_size=1, seq_len=8))
    with pytest.raises(ImportError, match=re.escape("pip install 'torchckpt[plot]'")):
        Frontier.plot(object.__new__(Frontier), tmp_path / "x.png")  # type: ignore[arg-type]
    with pytest.raises(CheckpointWriteError, match=re.escape("pip install 'torchckpt[remote]'")):
        FsspecStorage("memory://x")
    with pytest.raises(ImportError, match=re.escape("pip install 'torchckpt[train]'")):
        make_loader(ByteChunks(np.zeros(100, dtype=np.uint8), seq_len=9), batch_size=2, seed=0)

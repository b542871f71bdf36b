"""Import-only placeholders for ``torchvision`` and ``sgl_kernel``, for SGLang on a CPU-only machine.

Installed by ``tools/setup.sh --sglang`` into ``.venv-sglang`` only, and only where torch sees no
GPU. SGLang imports both while it starts (multimodal configs; its CUDA kernels), but its CPU
serving path with ``--attention-backend torch_native --sampling-backend pytorch`` calls
neither, and neither has a CPU build that installs beside torch 2.13.0+cpu. Any use of them
beyond the import raises, naming this file.

One defect of SGLang 0.5.23's CPU path is mended where it bites: with
``--enable-return-routed-experts`` its host buffer of routed experts is pinned through
``cudaHostRegister`` whatever the device, so a CPU server dies at start ("Torch not compiled
with CUDA enabled"). On the CPU that buffer is plain host memory (``HostBuffers``); nothing
else of SGLang's serving path is replaced.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

NAMES = ("torchvision", "sgl_kernel")


class Placeholder:
    """An attribute of a placeholder module: more attributes, a base class, never a call."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is an import-only placeholder ({__file__}) on this CPU machine")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self.__name__}.{attr}")


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``NAMES`` and their submodules that nothing else on the path answers."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = PlaceholderModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+placeholder"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


HOST_POOLS = "sglang.srt.mem_cache.pool_host.common"


def _plain_host_buffer(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any,
                       registration_granularity_bytes: int | None = None) -> Any:  # fmt: skip
    """SGLang's host-buffer allocator for ``cpu``, without registering the memory with CUDA."""
    return allocator.allocate(dims, dtype=dtype, device=device)


class HostBuffers(importlib.abc.MetaPathFinder):
    """Once SGLang's host-pool module is imported, its allocator for ``cpu`` allocates plain memory."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != HOST_POOLS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            module.ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_buffer

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if not any(isinstance(f, Finder) for f in sys.meta_path):
    sys.meta_path.append(Finder())  # last: a real installation, where one exists, wins
    sys.meta_path.insert(0, HostBuffers())

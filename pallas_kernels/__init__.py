"""titanax's kernel collection: pallas_kernels.flash_attention(q, k, v, ...) and pallas_kernels.fp8.

Loaded on first use: titanax.config validates backend names against the kernels' tables
(flash_attention/backends.py, fp8/backends.py: plain data) without importing jax.

`pallas_kernels.flash_attention` is the function, shadowing the subpackage on purpose (the
stable entry point); `from pallas_kernels.flash_attention import FlashConfig` still reaches
the subpackage through sys.modules. The import system records a subpackage on its parent with
setattr once it is loaded; the property below keeps the name on the function all the same.
"""

import importlib
import sys
import types


class _Package(types.ModuleType):
    @property
    def flash_attention(self):
        return importlib.import_module(".flash_attention.api", __name__).flash_attention

    @flash_attention.setter
    def flash_attention(self, _subpackage):
        pass  # the import system recording the subpackage: the name stays the function's

    @property
    def fp8(self):
        return importlib.import_module(".fp8", __name__)

    @fp8.setter
    def fp8(self, _subpackage):
        pass


sys.modules[__name__].__class__ = _Package

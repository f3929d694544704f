"""One file per decoder architecture, each composing engine/layers/ and registering its
names (engine/model/registry.py). Importing this package imports every file in it, so an
architecture is added by adding its file here and nothing else."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

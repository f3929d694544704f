"""Our top-level packages must not share an import name with another installed distribution.

The repository root is first on sys.path for the tests, `python -m kvbatch.fetch` and an
editable install, so a folder of ours named like a dependency's module hides that module from
everyone. It happened: our Triton kernels lived in `kernels/` until transformers 5.25 made Hugging
Face's kernel-hub package `kernels` a requirement and imported it at once; every fresh install
then failed in `from transformers import ...` with "cannot import name 'CUDAProperties' from
'kernels'". The folder is `kvkernels/` since.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_no_installed_distribution_shares_our_top_level_names():
    providers = importlib.metadata.packages_distributions()
    shared = {
        name: sorted(set(providers[name]) - {"kvbatch"})
        for name in OURS
        if set(providers.get(name, ())) - {"kvbatch"}
    }
    assert not shared, (
        f"these folders of ours hide the same-named modules of installed distributions: {shared};"
        " rename ours"
    )


def test_our_packages_are_installed_and_imported_from_this_tree():
    providers = importlib.metadata.packages_distributions()
    assert {"engine", "kvkernels", "jobs", "worker", "kvbatch"} <= set(OURS)
    for name in OURS:
        assert "kvbatch" in providers.get(name, ()), f"{name}/ is not in the kvbatch distribution"
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin) == ROOT / name / "__init__.py", (name, spec)


def test_transformers_imports_its_kernel_hub_integration():
    """The failure itself: transformers >= 5.25 imports `kernels` here on every model load."""
    import transformers.integrations.hub_kernels as hub

    kernels = importlib.util.find_spec("kernels")
    if kernels is not None:  # installed (transformers >= 5.25 requires it): theirs, not ours
        assert Path(kernels.origin).parent.parent != ROOT, kernels.origin
    assert hub.__name__ == "transformers.integrations.hub_kernels"

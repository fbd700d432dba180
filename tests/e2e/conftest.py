import pytest

from launches import COMMON, RECIPES, tessera


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted single-node 2-rank runs (ZeRO-2, megatron TP2; 10 steps) that the recovered and the
    multi-node runs must equal bit for bit."""
    base = tmp_path_factory.mktemp("ref")
    for name, recipe in RECIPES.items():
        p = tessera("run", recipe, *COMMON, f"run.out_dir={base / name}")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return base

"""The package's import rules (docs/ARCHITECTURE.md): lower stages never import higher ones,
only `megatron/`, `training/` and `data/` touch megatron-core, only `attention/backends.py`
touches flash-attn / TransformerEngine, and importing the package has no side effects."""

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_eod"
# Stage order; data/ prepares datasets and sits beside megatron/ (both may use megatron-core).
RANK = {"layout": 1, "plan": 2, "attention": 3, "megatron": 4, "data": 4, "training": 5}
MEGATRON_ALLOWED = {"megatron", "data", "training"}
KERNEL_MODULES = ("flash_attn", "transformer_engine", "apex")


def imports_of(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "import_megatron":
            yield "megatron.core"  # the quiet-import helper counts as a megatron-core import


def test_stage_import_rules():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        stage = parts[0] if len(parts) > 1 else None
        for name in imports_of(path):
            top = name.split(".")
            where = f"{path.relative_to(PACKAGE.parent)} imports {name}"
            if top[0] == "megatron_eod" and len(top) > 1 and stage in RANK and top[1] in RANK:
                if RANK[top[1]] > RANK[stage]:
                    violations.append(f"{where}: a lower stage imports a higher one")
            if top[0] == "megatron" and stage not in MEGATRON_ALLOWED:
                violations.append(f"{where}: only megatron/, data/, training/ use megatron-core")
            if top[0] in KERNEL_MODULES and parts[-2:] != ("attention", "backends.py"):
                violations.append(f"{where}: only attention/backends.py imports kernels")
    assert not violations, "\n".join(violations)


def test_importing_the_package_has_no_side_effects():
    code = ("import sys, megatron_eod, megatron_eod.data, megatron_eod.megatron.cpu_compat, "
            "megatron_eod.megatron.dataset, torch;"
            "assert not any(m.startswith('megatron.') for m in sys.modules), "
            "[m for m in sys.modules if m.startswith('megatron.')];"
            "assert torch.cuda.current_device is torch.cuda.__dict__['current_device']")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env)
    assert result.returncode == 0, result.stderr

"""The package's layering (docs/ARCHITECTURE.md): imports only go down, no cycle, no other module's private name.

Why a test: the redesign of issue 17 removed an import cycle (the fast decode <-> the band decode), upward imports (backends ->
kernels inside functions) and private names imported across modules; this keeps them from coming back, between
top-level modules and between the modules of one subpackage. The layer
of each top-level module or subpackage is the table below (the same as the architecture document's drawing); a
module may import its own layer or the ones under it, never one above. Imports inside functions count too.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vdbench"

#: top-level module or subpackage of vdbench -> its layer (0 = bottom)
LAYERS = {
    "numerics": 0, "measure": 0, "kernels": 0, "watchdog": 0, "sparse": 0,
    "capture": 0,
    "tiny": 0, "hostmem": 0, "timing": 0, "profiling": 0, "power": 0, "stages": 0, "helptext": 0,
    "backends": 1,
    "families": 2,
    "pipelines": 3, "scheduler": 3, "video": 3, "grid": 3, "vae": 3, "identity": 3, "kernel_bench": 3, "kernel_tune": 3, "vae_bench": 3, "fused_bench": 3, "sets": 3,
    "patching": 4, "parallel": 4, "speed": 4, "cache": 4, "offload": 4,
    "render": 5, "report": 5, "api": 5, "batch": 5, "pool": 5, "stitch": 5,
    "cli": 6, "sweep": 6, "options": 6, "render_all": 6,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name: str, path: Path, mods: dict) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import in the file, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if path.name == "__init__.py" else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full, None) if full in mods else (base, a.name))
        elif isinstance(node, ast.Import):
            out.extend((a.name, None) for a in node.names)
    return [(m, n) for m, n in out if m == "vdbench" or m.startswith("vdbench.")]


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_has_a_layer():
    tops = {_top(m) for m in _modules()} - {None}
    assert tops <= set(LAYERS), f"add {sorted(tops - set(LAYERS))} to LAYERS here and to docs/ARCHITECTURE.md"


def test_imports_only_go_down_and_never_reach_a_private_name():
    mods = _modules()
    up, private = [], []
    for name, path in mods.items():
        here = _top(name)
        for target, imported in _imports(name, path, mods):
            there = _top(target)
            if here is None or there is None or there == here:
                continue
            if LAYERS[there] > LAYERS[here]:
                up.append(f"{name} imports {target} (layer {LAYERS[there]} > {LAYERS[here]})")
            if imported and imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{name} imports {target}.{imported}")
    assert not up, "upward imports:\n" + "\n".join(up)
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_no_import_cycle_between_top_level_modules():
    mods = _modules()
    edges: dict[str, set] = {}
    for name, path in mods.items():
        here = _top(name)
        for target, _ in _imports(name, path, mods):
            there = _top(target)
            if here and there and there != here:
                edges.setdefault(here, set()).add(there)
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(edges):
        visit(node)


def _first_cycle(edges: dict) -> list | None:
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in seen:
            return None
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            found = visit(nxt)
            if found:
                return found
        stack.pop()
        seen.add(node)
        return None

    for node in sorted(edges):
        found = visit(node)
        if found:
            return found
    return None


def test_no_import_cycle_inside_a_subpackage():
    """A subpackage (vae/: decode, encode, fast, parallel, prewarm) is one layer, so the test above sees none of its
    own imports; its modules must still import one way (its ``__init__`` aside, which holds no code)."""
    mods = _modules()
    edges: dict[str, set] = {}
    for name, path in mods.items():
        here = _top(name)
        if not here or name == f"vdbench.{here}":
            continue
        for target, _ in _imports(name, path, mods):
            if _top(target) == here and target != f"vdbench.{here}" and target != name and target in mods:
                edges.setdefault(name, set()).add(target)
    cycle = _first_cycle(edges)
    assert not cycle, "import cycle: " + " -> ".join(cycle)

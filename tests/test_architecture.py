"""The code's shape, checked from the source (no imports, a second or two): no import cycles
between modules or between titanax's subpackages, layering (kernels know nothing of titanax,
the library nothing of its launchers), no function outside the kernels over 80 lines, no file
over 500 lines but the listed kernels, shape suffixes in the legend's letters, and the files
the packaging declares exist.
docs/architecture.md says why each rule is there."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"titanax": ROOT / "src" / "titanax", "pallas_kernels": ROOT / "pallas_kernels",
            "launch": ROOT / "launch"}
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500
# Files over MAX_FILE_LINES, each with why it stays whole (the cap is for files with several
# jobs; each of these has one).
LONG_FILES = {
    "pallas_kernels/flash_attention/kernel_sm90.py": "one Mosaic kernel body (the sm90 forward, "
    "its ping-pong and overlap forms): splitting it would move code the SASS tables pin",
    "pallas_kernels/flash_attention/kernel_sm100.py": "one Mosaic kernel body (the sm100 "
    "forward, its TMEM and correction forms): splitting it would move code the SASS tables pin",
    "pallas_kernels/flash_attention/kernel_sm100_bwd.py": "one Mosaic kernel body (the sm100 "
    "backward): splitting it would move code the SASS tables pin",
}
# Kernel bodies: a Pallas kernel is one function whose closures share the SMEM/TMEM refs and
# barriers it allocates; splitting it would thread a dozen refs through every piece.
KERNEL_FILES = ("pallas_kernels/flash_attention/kernel_*.py", "pallas_kernels/fp8/matmul_*.py")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [pkg, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours `name` lives in (an attribute import names its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every module of ours that `module` imports, at the top or inside a function (a lazy
    import hides a cycle; it does not remove it)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                prefix = base + ("." + node.module if node.module else "")
            else:
                prefix = node.module
            names = [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in map(_resolve, names) if t and t != module}
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _subpackage(module: str) -> str:
    """titanax.train.loop -> titanax.train; titanax.config -> titanax.config."""
    return ".".join(module.split(".")[:2])


def test_no_module_import_cycles():
    assert _cycles(GRAPH) == []


def test_no_import_cycles_between_titanax_subpackages():
    graph: dict[str, set[str]] = {}
    for m, targets in GRAPH.items():
        if not m.startswith("titanax."):
            continue
        for t in targets:
            a, b = _subpackage(m), _subpackage(t)
            if t.startswith("titanax.") and a != b:
                graph.setdefault(a, set()).add(b)
    assert _cycles(graph) == []


def _documented_tiers() -> dict[str, int]:
    """titanax subpackage -> its tier in docs/architecture.md's layering line (0: bottom)."""
    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    line = text.partition("the order, bottom up:")[2].partition("; `launch/` on top")[0]
    assert line, "docs/architecture.md lost its layering line ('the order, bottom up: ...')"
    return {f"titanax.{name}": tier for tier, names in enumerate(line.split("->"))
            for name in re.findall(r"`(\w+)`", names)}


def test_titanax_subpackages_import_only_the_tiers_below_theirs():
    """The layering order docs/architecture.md describes, import by import (inside functions
    too), and every subpackage placed in it."""
    tiers = _documented_tiers()
    subpackages = {_subpackage(m) for m in MODULES if m.startswith("titanax.")}
    assert sorted(subpackages - set(tiers)) == [], "not placed in docs/architecture.md's order"
    upward = sorted({f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                     if m.startswith("titanax.") and t.startswith("titanax.")
                     and _subpackage(m) != _subpackage(t)
                     and tiers[_subpackage(t)] >= tiers[_subpackage(m)]})
    assert upward == []


def test_layering_kernels_know_no_titanax_and_the_library_no_launcher():
    wrong = [f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
             if m.startswith("pallas_kernels") and not t.startswith("pallas_kernels")
             or m.startswith("titanax") and t.startswith("launch")]
    assert wrong == []


def _long_functions(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_outside_the_kernels_is_longer_than_80_lines():
    kernels = {p for pattern in KERNEL_FILES for p in ROOT.glob(pattern)}
    files = [p for root in [*PACKAGES.values(), ROOT / "tests", ROOT / "configs"]
             for p in root.rglob("*.py") if p not in kernels]
    assert [f for p in sorted(files) for f in _long_functions(p)] == []


def test_no_file_is_longer_than_500_lines_but_the_listed_kernels():
    """A file of more than 500 lines does more than one job (sass_audit.py was parser, cost
    model, windows, claims and table in 819): split it; the kernels in LONG_FILES are one
    function each. A listed file that shrinks under the cap leaves the list."""
    files = [p for root in [*PACKAGES.values(), ROOT / "tests", ROOT / "configs"]
             for p in root.rglob("*.py")]
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    long = {f: n for f, n in lines.items() if n > MAX_FILE_LINES}
    assert {f: n for f, n in long.items() if f not in LONG_FILES} == {}
    assert sorted(f for f in LONG_FILES if lines.get(f, 0) <= MAX_FILE_LINES) == []


def _legend_letters() -> set[str]:
    """The capitals docs/architecture.md's shape legend defines (its table's letter columns)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Shape letters", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| ([A-Z]) \|", section, re.M)
               + re.findall(r"\| \| ([A-Z]) \|", section))


def test_shape_suffixes_use_the_legend_letters():
    """Every shape suffix in titanax (`x_BSD`, `h_CBsD`, `keys_BS2`: the last `_` part, with a
    capital) uses the legend's letters, their lowercase (a part of that axis) and digits only."""
    legend = _legend_letters()
    assert {"B", "S", "D", "K"} <= legend, legend
    allowed = legend | {c.lower() for c in legend} | set("0123456789")
    offenders = set()
    for path in sorted(PACKAGES["titanax"].rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.id if isinstance(node, ast.Name) else node.arg
                    if isinstance(node, ast.arg) else node.attr
                    if isinstance(node, ast.Attribute) else None)
            m = re.fullmatch(r"[a-z][a-z0-9_]*_([a-z0-9]*[A-Z][A-Za-z0-9]*)", name or "")
            if m and not set(m[1]) <= allowed:
                offenders.add(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, sorted(offenders)


def test_declared_package_data_exists():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-data", {})
    missing = [f"{pkg}/{f}" for pkg, files in data.items() for f in files
               if not list((PACKAGES[pkg]).glob(f))]
    assert missing == []


def test_config_validates_backend_names_without_jax():
    """Config checks read the kernels' backend tables (plain data): validating a config must
    not pay for importing jax (launchers print config errors in a fraction of a second)."""
    probe = ("import sys, titanax.config as c; "
             "assert 'jax' not in sys.modules, 'titanax.config loaded jax'; "
             "assert 'mosaic_sm90' in c.ATTENTION_IMPLS and 'mxfp8' in c.MATMUL_PRECISIONS")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/: a test module is run, never imported (its
    fixtures, marks and module-level set-up would come along with the names)."""
    offenders = []
    for path in sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n.rpartition(".")[2].startswith("test_")]
    assert not offenders, "\n".join(offenders)


def test_architecture_doc_cites_only_paths_that_exist():
    """Every `path` docs/architecture.md names (a file or folder, as written or under src/,
    src/titanax/ or tests/, or a unique file name) exists in the tree; `module.Name` names a
    module that exists."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    known = set(files) | {"/".join(f.split("/")[:i]) for f in files
                          for i in range(1, f.count("/") + 1)}

    def exists(cited: str) -> bool:
        cited = cited.rstrip("/")
        if re.fullmatch(r"[\w/]+\.[A-Z]\w*", cited):  # models/hf_interop.HFInterop
            cited = cited.rpartition(".")[0] + ".py"
        return any(p + cited in known for p in ("", "src/", "src/titanax/", "tests/")) or \
            any(k.endswith("/" + cited) for k in known)

    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = {c for c in re.findall(r"`([^`\s]+)`", text)
             if ("/" in c or re.search(r"\.(py|md|sh|json|toml)$", c))
             and not re.search(r"[<*]", c)}
    assert cited and not sorted(c for c in cited if not exists(c)), sorted(
        c for c in cited if not exists(c))

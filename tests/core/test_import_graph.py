"""The import graph of the shipped packages (metalnn, metal_kernels), built from the source with `ast`.

Every ``import`` counts, also the ones inside functions. An import names the most specific module
it reaches (``from .. import functional`` is an edge to ``metalnn.functional``, ``from .x import
y`` to ``pkg.x`` or, when ``y`` is a module, to ``pkg.x.y``); the parent packages Python also
initialises on the way are not edges, or every submodule would sit in a circle with its package.
``from pkg import name`` where ``pkg/__init__.py`` does not bind ``name`` reaches a compiled
submodule (``metalnn.cpu._fastmath``): no edge to the package.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("metalnn", "metal_kernels")


def _modules():
    """``{dotted name: (path, is_package)}`` for every .py file of the packages."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_package)
    return mods


def _binds(path, name):
    """Whether a package's ``__init__.py`` binds ``name`` at its top level."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound == name or (alias.name == "*" and not name.startswith("_")):
                    return True
    return False


def _edges(name, path, is_package, mods):
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in mods:
                    targets.append(sub)
                elif source in mods and mods[source][1] and not _binds(mods[source][0], alias.name):
                    continue  # a compiled submodule, outside the graph
                else:
                    targets.append(source)
        else:
            continue
        for target in targets:
            # `import a.b.c` reaches a.b.c; keep the longest prefix that is one of our modules
            parts = target.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if parts and ".".join(parts) != name:
                out.add(".".join(parts))
    return out


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return {name: _edges(name, path, is_package, mods) for name, (path, is_package) in mods.items()}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def _inside(module, package):
    return module == package or module.startswith(package + ".")


#: the package facade re-exports the public API (``mn.models``, ``mn.generate``) and sets up the BLAS
#: before anything imports mlx; ``python -m metalnn`` runs the command line
FACADE = {"metalnn", "metalnn.__main__"}


def _violations(graph, allowed_importer, target):
    """Edges into ``target`` (a package) from modules ``allowed_importer`` refuses."""
    return sorted((src, dst) for src, dsts in graph.items() for dst in dsts
                  if _inside(dst, target) and not allowed_importer(src) and src not in FACADE)


def _llm_outsiders(graph):
    return (_violations(graph, lambda m: _inside(m, "metalnn.llm") or _inside(m, "metalnn.cli"), "metalnn.llm")
            + _violations(graph, lambda m: _inside(m, "metalnn.cli"), "metalnn.cli"))


def _cpu_outsiders(graph):
    return _violations(graph, lambda m: _inside(m, "metalnn.functional") or _inside(m, "metalnn.cpu"), "metalnn.cpu")


def _kernels_into_functional(graph):
    return sorted((src, dst) for src, dsts in graph.items() if _inside(src, "metalnn.kernels")
                  for dst in dsts if _inside(dst, "metalnn.functional") or dst == "metalnn")


def test_graph_is_built_from_the_real_imports(graph):
    # a few edges known from the source, so that an empty or broken graph cannot pass
    assert "metalnn.kernels.launch" in graph["metalnn.kernels.rms_norm"]
    assert "metalnn.kernels.attention" in graph["metalnn.functional.attention"]
    assert "metalnn.kernels.op_math" in graph["metalnn.kernels.rope"]
    assert "metal_kernels.emulator" in graph["metalnn.kernels.launch"]     # inside a function
    assert "metalnn.functional" in graph["metalnn"]
    assert "metalnn.cpu.fused" in graph["metalnn.functional._dispatch"]
    assert "metalnn.layers.base" in graph["metalnn.llm.models.llama"]


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles(graph):
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nothing_outside_llm_and_cli_imports_them(graph):
    bad = _llm_outsiders(graph)
    assert not bad, f"modules outside metalnn.llm / metalnn.cli import them: {bad}"


def test_only_functional_imports_the_cpu_backend(graph):
    bad = _cpu_outsiders(graph)
    assert not bad, f"modules other than metalnn.functional import metalnn.cpu: {bad}"


def test_kernels_do_not_import_functional(graph):
    bad = _kernels_into_functional(graph)
    assert not bad, f"metalnn.kernels imports metalnn.functional (or the metalnn package): {bad}"


@pytest.mark.parametrize("importer, target, rule", [
    ("metalnn.layers.linear", "metalnn.llm.models", _llm_outsiders),
    ("metalnn.trainer", "metalnn.cli.common", _llm_outsiders),
    ("metalnn.layers.attention", "metalnn.cpu.fastmath", _cpu_outsiders),
    ("metalnn.losses", "metalnn.cpu.fused", _cpu_outsiders),
    ("metalnn.kernels.rope", "metalnn.functional._dispatch", _kernels_into_functional),
])
def test_each_rule_catches_a_planted_import(graph, importer, target, rule):
    """Each direction rule fails when one forbidden edge is added to the real graph."""
    assert not rule(graph)
    planted = {name: set(edges) for name, edges in graph.items()}
    planted[importer].add(target)
    assert (importer, target) in rule(planted)


def test_a_planted_cycle_is_found(graph):
    planted = {name: set(edges) for name, edges in graph.items()}
    planted["metalnn.layers.base"].add("metalnn.layers.linear")   # linear imports base
    assert _cycle(planted) is not None


# -- every architecture module of metalnn.llm.models declares its ModelArgs and registers once ------------

MODELS = ROOT / "metalnn" / "llm" / "models"
#: the shared pieces of metalnn.llm.models; every other module there is an architecture
SHARED_MODEL_MODULES = {"__init__", "base", "registry", "loading", "decoder", "rope", "hybrid", "experts"}


def _named(node) -> str:
    """``register`` for ``register(...)`` and ``registry.register(...)``; '' for other callees."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _architecture_problems(source: str, module: str, shared: bool = False) -> list:
    """What is wrong with an architecture module's source (``shared``: a shared piece, which must
    neither register nor define a model class)."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    registers = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _named(n.func) == "register"]
    models = [c for c in classes.values() if any(_named(b) == "CausalLM" for b in c.bases)]
    if shared:
        return ([f"{module}: a shared module calls register"] * bool(registers)
                + [f"{module}: a shared module defines a CausalLM subclass {c.name}" for c in models])
    problems = []
    args = classes.get("ModelArgs")
    if args is None:
        problems.append(f"{module}: no ModelArgs class")
    elif not any(_named(b) == "BaseModelArgs" for b in args.bases) or \
            not any(_named(d.func if isinstance(d, ast.Call) else d) == "dataclass" for d in args.decorator_list):
        problems.append(f"{module}: ModelArgs is not a BaseModelArgs dataclass")
    if len(registers) != 1:
        problems.append(f"{module}: register is called {len(registers)} times (expected once)")
    if len(models) != 1:
        problems.append(f"{module}: {len(models)} CausalLM subclasses (expected one)")
    for c in models:
        if not any(_named(d.func if isinstance(d, ast.Call) else d) == "register" for d in c.decorator_list):
            problems.append(f"{module}: {c.name} is not registered by a decorator")
        sets_args = any(isinstance(s, ast.Assign) and any(_named(t) == "args_class" for t in s.targets)
                        and _named(s.value) == "ModelArgs" for s in c.body)
        if not sets_args:
            problems.append(f"{module}: {c.name} does not set args_class = ModelArgs")
    return problems


def test_every_architecture_module_declares_model_args_and_registers_once():
    paths = sorted(MODELS.glob("*.py"))
    names = {p.stem for p in paths}
    assert SHARED_MODEL_MODULES <= names, SHARED_MODEL_MODULES - names
    architectures = names - SHARED_MODEL_MODULES
    assert {"llama", "gpt2", "qwen2", "qwen3", "mistral", "qwen3_next", "qwen3_5"} <= architectures
    problems = [p for path in paths for p in _architecture_problems(path.read_text(), path.stem,
                                                                    shared=path.stem in SHARED_MODEL_MODULES)]
    assert not problems, problems
    # and at run time: one registry entry per architecture module, none from elsewhere
    from metalnn.llm.models import ARCHITECTURES

    registered = [e.model.__module__.rpartition(".")[2] for e in ARCHITECTURES.entries()]
    assert sorted(registered) == sorted(architectures)


GOOD_ARCHITECTURE = '''
@dataclass
class ModelArgs(BaseModelArgs):
    vocab_size: int

@register("FooForCausalLM", model_types=("foo",))
class FooForCausalLM(CausalLM):
    args_class = ModelArgs
'''


@pytest.mark.parametrize("source, words", [
    (GOOD_ARCHITECTURE.replace("class ModelArgs(BaseModelArgs)", "class FooArgs(BaseModelArgs)"), "no ModelArgs"),
    (GOOD_ARCHITECTURE.replace("@dataclass\n", ""), "not a BaseModelArgs dataclass"),
    (GOOD_ARCHITECTURE.replace('@register("FooForCausalLM", model_types=("foo",))\n', ""), "called 0 times"),
    (GOOD_ARCHITECTURE + 'register("BarForCausalLM", model_types=("bar",))(FooForCausalLM)\n', "called 2 times"),
    (GOOD_ARCHITECTURE + "\nclass Bar(CausalLM):\n    args_class = ModelArgs\n", "2 CausalLM subclasses"),
    (GOOD_ARCHITECTURE.replace("args_class = ModelArgs", "pass"), "does not set args_class"),
])
def test_the_architecture_rule_catches_a_planted_module(source, words):
    assert _architecture_problems(GOOD_ARCHITECTURE, "foo") == []
    problems = _architecture_problems(source, "foo")
    assert any(words in p for p in problems), problems


def test_a_shared_module_may_not_register():
    assert _architecture_problems("from .base import CausalLM\n", "decoder", shared=True) == []
    assert _architecture_problems(GOOD_ARCHITECTURE, "decoder", shared=True) == [
        "decoder: a shared module calls register", "decoder: a shared module defines a CausalLM subclass "
        "FooForCausalLM"]

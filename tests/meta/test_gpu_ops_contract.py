"""Each FlashInfer generation's GPU ops implement the two typed contracts of ``gpu/ops.py``
(``Ops`` for the single-GPU driver, ``PoolOps`` for the rank pool's one driver) with every
method and its parameters, and the GPU folder's drivers name no engine: an engine's step on a
rank is its own rank body, opened by its record. Read on the CPU (no kernel is touched)."""
import ast
import inspect
import re

import pytest

from dispatcher.engines import ENGINES
from dispatcher.model.generations import GENERATIONS

from .. import SOURCE

GPU = SOURCE / "dispatcher" / "gpu"


def _methods(protocol) -> dict:
    """The methods the contract itself writes (its ``__init__`` where it has one)."""
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and (not name.startswith("_") or name == "__init__")
            and fn.__qualname__ == f"{protocol.__name__}.{name}"}


@pytest.mark.parametrize("version", list(GENERATIONS))
@pytest.mark.parametrize("contract", ["Ops", "PoolOps"])
def test_each_generation_implements_both_contracts(version, contract):
    pytest.importorskip("torch")
    from dispatcher.gpu import ops

    protocol = getattr(ops, contract)
    module = ops.ops_of(GENERATIONS[version])
    cls = getattr(module, contract, None)
    assert cls is not None, f"{module.__name__} has no {contract} class"
    for name, wanted in _methods(protocol).items():
        mine = getattr(cls, name, None)
        assert callable(mine), f"{module.__name__}.{contract} lacks {name}()"
        got = list(inspect.signature(mine).parameters)
        assert got == list(wanted.parameters), (
            f"{module.__name__}.{contract}.{name}{inspect.signature(mine)} is not the "
            f"contract's {name}{wanted}")
    assert issubclass(cls, protocol)  # runtime_checkable: every member is there


def test_a_class_missing_a_method_breaks_the_contract():
    """The check above can fail: a PoolOps without its combine is no PoolOps."""
    pytest.importorskip("torch")
    from dispatcher.gpu import ops

    module = ops.ops_of(GENERATIONS[next(iter(GENERATIONS))])
    partial = type("Partial", (), {k: v for k, v in vars(module.PoolOps).items()
                                   if k != "combine"})
    assert not issubclass(partial, ops.PoolOps)
    assert issubclass(module.PoolOps, ops.PoolOps)


def _code_words(path) -> set:
    """The identifiers and string constants of a module's code (docstrings and comments
    aside): what it runs, not what it tells a reader."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            words.update(re.findall(r"[A-Za-z_]+", node.value))
        elif isinstance(node, ast.Name):
            words.update(node.id.split("_"))
        elif isinstance(node, ast.Attribute):
            words.update(node.attr.split("_"))
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            for alias in node.names:
                words.update(re.split(r"[._]", alias.name))
            words.update(re.split(r"[._]", getattr(node, "module", None) or ""))
    return {w.lower() for w in words}


@pytest.mark.parametrize("path", sorted(GPU.glob("*.py")), ids=lambda p: p.name)
def test_the_gpu_folder_names_no_engine(path):
    named = sorted(_code_words(path) & set(ENGINES))
    assert not named, (f"dispatcher/gpu/{path.name} names the engine(s) {named} in its code: "
                       f"an engine's step on a rank is its rank body (Engine.rank_body)")


def test_an_engine_named_in_code_is_found(tmp_path):
    """The check above can fail: the pool's old dispatch on the message kind is found."""
    name = next(iter(ENGINES))
    module = tmp_path / "pool.py"
    module.write_text(f'"""{name} in a docstring is fine."""\n'
                      f'def serve(kind):\n    if kind == "{name}":  # a comment is fine\n'
                      f'        return 1\n')
    assert name in _code_words(module)
    module.write_text(f'"""{name} in a docstring is fine."""\nfrom .x import run_{name}_example\n')
    assert name in _code_words(module)
    module.write_text(f'"""{name} in a docstring is fine."""\n# {name}\n')
    assert name not in _code_words(module)

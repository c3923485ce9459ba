"""The shape of the code: imports run one way (no circle), every module imports on its own, and train.py's loop
has no branch per task (a task's loss and evaluation live in its entry of tasks.TASKS).

Imports are read with ast, function-level ones included (an import inside a function closes a circle as
surely as one at the top). Run: python -m pytest tests/test_structure.py -q
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))     # the flat top-level modules
# the functions of train.py that run for every step or evaluation
LOOP = ("train", "train_step", "log_step", "console_parts", "evaluate_and_keep_best", "save_last")


def project_imports(module):
    """The project modules that `module` imports anywhere in its file (top level or inside functions)."""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py"), encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return sorted(found & set(MODULES) - {module})


def find_circle(graph):
    """One import circle as [a, b, ..., a], or None (depth-first search for an edge back into the path)."""
    state = {}                                   # module -> "open" (on the path) or "done"

    def visit(m, path):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                return path[path.index(n):] + [n] if n in path else path + [m, n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in graph:
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_imports_run_one_way():
    graph = {m: project_imports(m) for m in MODULES}
    assert find_circle(graph) is None, "import circle: " + " -> ".join(find_circle(graph))
    # the layering tasks.py's docstring describes: base types below the readers, the readers below the table
    for low, high in (("data", "lra"), ("data", "qa"), ("data", "tasks"), ("lra", "tasks"), ("qa", "tasks"),
                      ("tasks", "train")):
        assert high not in graph[low], f"{low}.py imports {high}.py, which builds on it"


def test_find_circle_finds_one():
    """The checker itself: a circle of three is found, a chain is not."""
    assert find_circle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_circle({"a": ["b"], "b": ["c"], "c": []}) is None


# Imports every project module first, each in a fresh child: the third-party libraries are imported once, then
# each child forks from that state, so no project module is loaded before the one under test.
FORK_EACH = """
import importlib, os, sys, traceback
import numpy, torch, torch._dynamo, torch.distributed, tqdm, tokenizers, sentencepiece   # third-party: shared
for m in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(m)
            os._exit(0)
        except BaseException:
            print(m + ": " + traceback.format_exc().strip().splitlines()[-1], flush=True)
            os._exit(1)
    os.waitpid(pid, 0)
"""


def test_each_module_imports_first_in_a_fresh_interpreter():
    """`import M` as the first project import of a fresh interpreter, for every module (a circle fails only when
    it is entered at some modules)."""
    p = subprocess.run([sys.executable, "-c", FORK_EACH, *MODULES], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 0 and not p.stdout.strip(), p.stdout + p.stderr[-2000:]


def _compares(node):
    """The source of every comparison under node."""
    return [ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Compare)]


def test_train_loop_has_no_branch_per_task():
    """train.py never compares a task's head, and the loop's functions never look at which task runs."""
    tree = ast.parse(open(os.path.join(ROOT, "train.py"), encoding="utf-8").read())
    heads = [c for c in _compares(tree) if ".head" in c]
    assert not heads, f"train.py branches on the model head: {heads}"
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert set(LOOP) <= set(functions), set(LOOP) - set(functions)
    for name in LOOP:
        per_task = [c for c in _compares(functions[name])
                    if any(w in c for w in ("task", "num_labels", "is_regression", "metric_name", "head"))]
        assert not per_task, f"train.{name} branches on the task: {per_task}"


@pytest.mark.parametrize("name", __import__("tasks").TASKS)
def test_every_task_has_reader_loss_and_evaluation(name):
    import tasks
    k = tasks.TASKS[name]
    assert callable(k.load) and callable(k.loss) and callable(k.evaluate) and k.max_len > 0

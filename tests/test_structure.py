"""The shape of the code (the design card, issue "Freeze and fold"): six flat files at the top level and no other
Python there; each opens with a docstring, at least one line in eight a comment (all six together: one in five),
no line over 100 characters; imports run one way with no circle (data.py imports no module of the project,
not even inside a function; model <- data, attendout, sparse; train <- everything; the methods attendout, sparse
and sar are leaves; nothing of the six imports research/ or readers/ at module level); every module imports first
in a fresh interpreter; every task has a reader and an objective train.py knows; README.md is a front door, its
sections in order; no line of research/*.py (research/'s top level) is over 100 characters either. No cap on a
file's number of lines and no flag cap: a student who adds a flag or a Config field must not fail here.

Imports are read with ast, function-level ones included. Run: python -m pytest tests/test_structure.py -q
"""
import ast
import io
import os
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = sorted(["attendout", "data", "model", "sar", "sparse", "train"])     # the six files of the course
# who may import whom among the six (anywhere in the file): data is the bottom, the methods are leaves
ALLOWED = {"data": set(), "attendout": set(), "sparse": set(), "sar": set(),
           "model": {"data", "attendout", "sparse"}, "train": {"data", "model", "attendout", "sparse", "sar"}}


def source(module):
    with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
        return f.read()


def comment_share(src):
    """(lines carrying a `#` comment, non-blank lines); docstrings are not comments."""
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    return len(comments), sum(1 for line in src.splitlines() if line.strip())


def imports(src, top_level_only=False):
    """The first component of every module `src` imports (top level only, or anywhere)."""
    tree = ast.parse(src)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_top_level_holds_the_six_files_and_no_other_python():
    assert sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")) == CORE


@pytest.mark.parametrize("module", CORE)
def test_docstring_comments_and_line_length(module):
    src = source(module)
    lines = src.splitlines()
    comments, non_blank = comment_share(src)
    assert comments * 8 >= non_blank, f"{module}.py: {comments} of {non_blank} lines carry a comment (< 1 in 8)"
    long = [n for n, line in enumerate(lines, 1) if len(line) > 100]
    assert not long, f"{module}.py: lines over 100 characters: {long[:10]}"
    assert ast.get_docstring(ast.parse(src)), f"{module}.py opens with no docstring"


@pytest.mark.parametrize("path", sorted(f for f in os.listdir(os.path.join(ROOT, "research")) if f.endswith(".py")))
def test_research_lines_at_most_100_characters(path):
    with open(os.path.join(ROOT, "research", path), encoding="utf-8") as f:
        long = [n for n, line in enumerate(f.read().splitlines(), 1) if len(line) > 100]
    assert not long, f"research/{path}: lines over 100 characters: {long[:10]}"


def test_the_six_together():
    shares = [comment_share(source(m)) for m in CORE]
    comments, non_blank = sum(c for c, _ in shares), sum(n for _, n in shares)
    assert comments * 5 >= non_blank, f"{comments} of {non_blank} lines carry a comment (< 1 in 5)"


def test_comment_share_counts_comments_not_docstrings():
    """The checker itself: a docstring line is not a comment, a trailing `#` is, a `#` inside a string is not."""
    assert comment_share('"""doc\n# not a comment\n"""\nx = 1  # one\ny = "#"\n') == (1, 5)


def test_imports_run_one_way():
    for module in CORE:
        mine = imports(source(module)) & set(CORE) - {module}
        assert mine <= ALLOWED[module], f"{module}.py imports {sorted(mine - ALLOWED[module])}"
        outside = imports(source(module), top_level_only=True) & {"research", "readers"}
        assert not outside, f"{module}.py imports {sorted(outside)} at module level"
    # data.py is the bottom layer: not even a function of it imports readers/ or research/
    below = imports(source("data")) & {"research", "readers"}
    assert not below, f"data.py imports {sorted(below)}"


def test_no_import_cycle():
    """Among the six and readers/ (imports anywhere in a file), no module reaches itself again: data.py loading
    readers/, which import data.py back, was such a circle."""
    nodes = set(CORE) | {"readers"}
    graph = {m: imports(source(m)) & nodes - {m} for m in CORE}
    graph["readers"] = set().union(*(imports(source(os.path.join("readers", m))) for m in ("lra", "mlm", "qa")))
    graph["readers"] &= nodes - {"readers"}

    def reach(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen
    cycles = [m for m in CORE if m in reach(m)]
    assert not cycles, f"import cycle through {cycles}"


def test_readme_is_a_front_door():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    # the front door's parts, in this order (a section added between them is fine; no line count)
    wanted = ["## Quickstart", "## A tour of the ideas", "## Fine-tuning a pretrained checkpoint",
              "## Headline results"]
    at = [readme.find("\n" + heading + "\n") for heading in wanted]
    assert -1 not in at and at == sorted(at), dict(zip(wanted, at))
    assert "/work/" not in readme and "../shared" not in readme, "README names a machine path"


# Each module imported first, in a fresh child of an interpreter that has loaded the third-party libraries once.
FORK_EACH = """
import importlib, os, sys, traceback
import numpy, torch, torch.distributed, tqdm, tokenizers, sentencepiece
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
    p = subprocess.run([sys.executable, "-c", FORK_EACH, *CORE, "readers.lra", "readers.qa", "readers.mlm"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 0 and not p.stdout.strip(), p.stdout + p.stderr[-2000:]


@pytest.mark.parametrize("name", __import__("data").TASKS)
def test_every_task_has_a_reader_and_an_objective_train_knows(name):
    import data
    import train
    loss, evaluate = train.objective(name)
    assert callable(loss) and callable(evaluate) and data.TASKS[name].max_len > 0
    read = train.reader(name)                          # data.py, or a module of readers/
    assert callable(read.load_task) and (read is data) == (data.TASKS[name].load is not None)

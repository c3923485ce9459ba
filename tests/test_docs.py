"""The documents point at things that exist: every `module.name` that README.md and docs/*.md cite (in backticks)
(and every `Class.name` of a project class) is defined in the code, and every methods.md section reference
(methods.md §N, §N.M, or a link to a heading of docs/methods.md), in the documents and in the code's comments,
names a heading of docs/methods.md.

A rename in the code without the documents fails here, naming the document, the line and the stale pointer.
Run: python -m pytest tests/test_docs.py -q
"""
import ast
import glob
import importlib
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py")))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
CODE = [m + ".py" for m in MODULES] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "*.py")))
# `module.name` inside a backtick span, e.g. `sparse.key_layout`, `attendout.AttendOut.hook(...)`, `train.py`
CITED = re.compile(r"\b(" + "|".join(MODULES) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
CLASS_CITED = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")   # `GNet.logits`, not `x.GNet`
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
ANCHOR = re.compile(r"methods\.md#([\w-]+)")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def inline_code(text):
    """(line number, span) of every `...` span outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(n, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def project_class(name):
    """The module that defines class `name`, or None (then `Name.x` is not ours: torch's, a paper's notation)."""
    for module in MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        if inspect.isclass(obj) and obj.__module__ == module:
            return module
    return None


def code_lists(text):
    """[(line, "module.name")] of the "Code: `file.py`: `name`, `Class.name` ..." lists of a paragraph: a bare
    name there belongs to the last `file.py` before it. Spans inside parentheses are notes (`Z`, flag values), not
    names of that file; the list ends with its sentence."""
    found = []
    lines = text.splitlines()
    start = 0
    for end in [i for i, line in enumerate(lines) if not line.strip()] + [len(lines)]:
        para = "\n".join(lines[start:end])
        first = start + 1
        start = end + 1
        at = para.find("Code:")
        if at < 0:
            continue
        module, depth, i = None, 0, at
        while i < len(para):
            c = para[i]
            if c == "`":
                close = para.index("`", i + 1)
                span, i = para[i + 1:close], close + 1
                if span.endswith(".py") and span[:-3] in MODULES:
                    module = span[:-3]
                elif (module and depth == 0 and span.split(".")[0] not in MODULES
                      and re.fullmatch(r"[A-Za-z_]\w+(?:\.[A-Za-z_]\w*)*", span)):
                    found.append((first + para.count("\n", 0, i), f"{module}.{span}"))
                continue
            depth += (c == "(") - (c == ")")
            if c == "." and depth == 0 and para[i + 1:i + 2] in (" ", "\n", ""):
                module = None                               # the sentence, and the list, ends
            i += 1
    return found


def cited_names(path):
    """[(line, "module.name")] that a document cites: `module.name...`, `Class.name...` of a project class (as
    module.Class.name), and the names of "Code:" lists; "module.py" (a file) and "module.md" are not names."""
    found = code_lists(read(path))
    for n, span in inline_code(read(path)):
        for module, dotted in CITED.findall(span):
            if dotted.split(".")[0] not in ("py", "md", "json", "jsonl", "tsv", "pt"):
                found.append((n, f"{module}.{dotted}"))
        for cls, dotted in CLASS_CITED.findall(span):
            module = project_class(cls)
            if module is not None:
                found.append((n, f"{module}.{cls}.{dotted}"))
    return found


def defined_on_instances(cls, name):
    """True when the class (or a base) sets self.<name> in a method, or declares it as an annotated field."""
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError, IndentationError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                return True
    return False


def resolves(dotted):
    """Whether module.a.b... names something in the code (attributes of classes' instances count)."""
    module, *parts = dotted.split(".")
    obj = importlib.import_module(module)
    for part in parts:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.isclass(obj) and defined_on_instances(obj, part):
            return True                                  # an instance attribute: nothing further to check
        else:
            return False
    return True


def methods_sections():
    """{"2", "2.1", ...: anchor} of docs/methods.md's numbered headings, anchors as GitHub makes them."""
    out = {}
    for line in read(os.path.join("docs", "methods.md")).splitlines():
        m = re.match(r"#+\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m:
            title = line.lstrip("#").strip().lower()
            out[m.group(1)] = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
    return out


def section_refs(path):
    """[(line, "§N.M" or "#anchor")]: the methods.md sections a file cites. In code only "methods.md §N" counts
    (a bare § in code could mean a paper's section); documents cite methods.md alone."""
    out = []
    for n, line in enumerate(read(path).splitlines(), 1):
        if path.endswith(".py"):
            out += [(n, "§" + s) for s in re.findall(r"methods\.md,? §(\d+(?:\.\d+)*)", line)]
        else:
            out += [(n, "§" + s.rstrip(".")) for s in SECTION.findall(line)]
        out += [(n, "#" + a) for a in ANCHOR.findall(line)]
    return out


@pytest.mark.parametrize("path", DOCS)
def test_every_cited_name_exists(path):
    stale = [f"{path}:{n}: `{name}`" for n, name in cited_names(path) if not resolves(name)]
    assert not stale, "names cited but not in the code:\n" + "\n".join(stale)


@pytest.mark.parametrize("path", DOCS + CODE)
def test_every_methods_section_reference_resolves(path):
    sections = methods_sections()
    bad = [f"{path}:{n}: {ref}" for n, ref in section_refs(path)
           if (ref[0] == "§" and ref[1:] not in sections) or (ref[0] == "#" and ref[1:] not in sections.values())]
    assert not bad, "methods.md sections that do not exist:\n" + "\n".join(bad)


def test_the_checks_see_the_documents():
    """The checks are not vacuous: the documents cite many names, and README links many methods.md sections."""
    assert sum(len(cited_names(p)) for p in DOCS) > 50
    assert len(section_refs("README.md")) > 5
    assert not resolves("sparse.no_such_function") and resolves("sparse.key_layout")
    assert resolves("model.Model.cls") and not resolves("model.Model.no_such_attribute")   # set in __init__
    assert project_class("GNet") == "attendout" and project_class("Tensor") is None

"""The documents point at things that exist: every `module.name` that README.md and docs/*.md cite (in backticks)
(and every `Class.name` of a project class) is defined in the code, and every methods.md section reference
(methods.md §N, §N.M, or a link to a heading of docs/methods.md), in the documents and in the code's comments,
names a heading of docs/methods.md. Every relative link and image of README.md and docs/**/*.md, and every
path-like mention of a file under docs/ (in the documents and in the code), names a file that exists; the
measured tables, their JSON and the figures live in docs/results/, the guides at docs/'s top.

A rename in the code without the documents fails here, naming the document, the line and the stale pointer.
Run: python -m pytest tests/test_docs.py -q
"""
import ast
import glob
import importlib
import inspect
import os
import re
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py")))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)                  # the guides and docs/results/'s notes
                              for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
CODE = [m + ".py" for m in MODULES] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "*.py")))
# every file that may name a file of docs/: the documents, the code at the top, readers/, research/ (its tests too)
# and tests/
MENTIONERS = DOCS + sorted(os.path.relpath(p, ROOT) for pattern in ("*.py", "readers/*.py", "research/**/*.py",
                                                                     "research/**/*.sh", "tests/*.py")
                           for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))
# `module.name` inside a backtick span, e.g. `sparse.key_layout`, `attendout.AttendOut.hook(...)`, `train.py`
CITED = re.compile(r"\b(" + "|".join(MODULES) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
CLASS_CITED = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")   # `GNet.logits`, not `x.GNet`
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
ANCHOR = re.compile(r"methods\.md#([\w-]+)")
# a link's or an image's target: `](target)` or `](<target> "title")`; reference definitions `[name]: target`
LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
# a path into docs/ in prose, backticks, code blocks or code: docs/methods.md, docs/results/bench_cpu.json, a glob
# (docs/results/attention_*.png); not out/docs/... and not an f-string's docs/{name}.png
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w.*/-]*\.(?:md|json|png)(?!\w)")


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


def links(text):
    """[(line, target)] of every link and image of a Markdown text, outside fenced code blocks and `code spans`."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    # a code span may wrap onto the next line: blank spans over the whole text, keeping its line breaks
    prose = re.sub(r"`[^`]*`", lambda m: "\n" * m.group().count("\n"), "\n".join(lines))
    found = [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(prose)]
    return found + [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in REFERENCE.finditer(prose)]


def broken_links(path, text=None):
    """["doc:line: target"] of the relative links of a document that name no file (#anchors stripped; web links,
    mailto: and a page's own #anchors are not files)."""
    bad = []
    for n, target in links(read(path) if text is None else text):
        if not target or target.startswith("#") or re.match(r"[A-Za-z][\w+.-]*:", target):
            continue
        file = urllib.parse.unquote(target.split("#")[0])
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file))
        if not (full.startswith(ROOT + os.sep) and os.path.isfile(full)):
            bad.append(f"{path}:{n}: ({target})")
    return bad


def docs_mentions(path, text=None):
    """[(line, "docs/...")] of the paths into docs/ a file names, anywhere in it (a path from the repository's root)."""
    text = read(path) if text is None else text
    return [(n, m) for n, line in enumerate(text.splitlines(), 1) for m in DOCS_PATH.findall(line)]


def missing_mentions(path, text=None):
    """["file:line: docs/..."] of the paths into docs/ that name no file (a glob: no file at all)."""
    return [f"{path}:{n}: {m}" for n, m in docs_mentions(path, text) if not glob.glob(os.path.join(ROOT, m))]


@pytest.mark.parametrize("path", DOCS)
def test_every_relative_link_resolves(path):
    bad = broken_links(path)
    assert not bad, "links to files that do not exist (relative to the document):\n" + "\n".join(bad)


@pytest.mark.parametrize("path", MENTIONERS)
def test_every_docs_path_mentioned_exists(path):
    bad = missing_mentions(path)
    assert not bad, "paths into docs/ that name no file:\n" + "\n".join(bad)


def test_docs_top_holds_the_guides_and_results_the_rest():
    """The measured tables (results_*.md), the JSON and the figures live in docs/results/, not at docs/'s top."""
    top = os.listdir(os.path.join(ROOT, "docs"))
    astray = sorted(f for f in top if f.endswith((".json", ".png")) or re.fullmatch(r"results_.*\.md", f))
    assert not astray, f"docs/: these belong in docs/results/: {astray}"
    assert {"methods.md", "results.md", "exercises.md", "tasks.md"} <= set(top)


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
    # the link checks see docs/results/'s notes, the links of results.md and README's, and the code's paths
    assert "docs/results/results_lab.md" in DOCS and "research/patterns.py" in MENTIONERS
    assert len(links(read("docs/results.md"))) > 50 and len(links(read("README.md"))) > 20
    assert sum(len(docs_mentions(p)) for p in MENTIONERS) > 20
    # and they catch a broken link, image, reference and mention, naming the document and the line (the paths
    # here are spelled so that this file's own check does not read them)
    doc = "[ok](methods.md) ![ok](results/scaling.png) [web](https://x.org/a.md) [here](#top)\n" \
          "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n" \
          "[gone](results_lab.md#x)\n![gone](scaling.png)\n[ref]: nowhere.md\n"
    top, notes = os.path.join("docs", "x.md"), os.path.join("docs", "results", "x.md")
    assert broken_links(top, doc) == [f"{top}:6: (results_lab.md#x)", f"{top}:7: (scaling.png)",
                                      f"{top}:8: (nowhere.md)"]
    assert broken_links(notes, "[up](../methods.md)\n[no](methods.md)") == [f"{notes}:2: (methods.md)"]
    code = "# docs/methods.md, docs/results/attention_*.png\nx = 'docs/" "scaling.png'  # out/docs/no.md\n"
    assert missing_mentions("x.py", code) == ["x.py:2: docs/" "scaling.png"]

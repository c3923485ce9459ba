"""The commands the documents print run as printed: every `python train.py ...`, `python model.py ...` and
`python research/experiments.py ...` of README.md and docs/*.md (the guides at docs/'s top), in code blocks and
in backtick spans, goes through its own program's parser: train.parse_args, model.parse_args, and
experiments.parse_args with --dry-run appended at the end (it must stay the grid's, not train.py's), whose --extra
flags then go through train.parse_args too. A parser's `error:` line fails here, naming the document, its line and
the command. Then the lab loop of docs/exercises.md runs as a shell would run it, with --dry-run at its end or
before --extra: it prints its runs and starts none; a wrong --extra or --base is one `error:` line.

How a command is read:
- a code block's line with its `\\` continuations joined, or a backtick span (which may cross a line break);
  the command starts at `python PROGRAM` and ends at a `# comment` or a shell operator (&&, |, ;, >, <);
- inside a code block's `for VAR in WORDS; do ... done`, a command with `$VAR` is read once per word, as the
  shell runs it (`--attn-dropout $m` in turn standard, none, attendout);
- an UPPERCASE word is a placeholder the reader fills in (OUT, DATA, HF_DIR, CKPT); it parses as itself where
  the flag takes a path or a name, and PLACEHOLDERS gives its value where the flag takes a number (`--seed S`);
- skipped, each for a stated reason: a command that elides its rest with `...`; one that uses a flag or a task
  an exercise adds (EXERCISE_NAMES: it runs once the exercise is done); a prose template that is no full
  command (`lab --variants ROW --extra=...`, no `python PROGRAM`); the spans of MENTIONS, which name a
  subcommand or a grid in prose without its operands: their subcommand must exist, and each must still be
  printed somewhere (a stale entry fails).

Run: python -m pytest tests/test_commands.py -q
"""
import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "research"))                    # `import experiments`
import experiments  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PROGRAM = re.compile(r"\bpython (train\.py|model\.py|research/experiments\.py)(?![\w./-])")
LOOP = re.compile(r"^\s*for (\w+) in (.+); do\s*$")
# a placeholder's value where its flag takes a number
PLACEHOLDERS = {"S": "0"}
# flags and tasks that an exercise of docs/exercises.md adds: a command using one runs after the exercise
EXERCISE_NAMES = {"--gnet-mask": "exercise 4", "lab-order": "exercise 12", "window-sweep": "exercise 14"}
# spans that name a subcommand or a grid in prose, without the operands a command needs: the names they use
MENTIONS = {"python model.py export": ["export"],
            "python model.py export --hf": ["export"],
            "python research/experiments.py pretrained-attendout": ["pretrained-attendout"]}


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def snippets(text):
    """(line number, text) of every code block line (its continuations joined; in a `for` loop once per value
    of the loop's variable) and every backtick span outside code blocks (a span may cross a line break)."""
    found, prose = [], []
    lines = text.splitlines()
    fenced, loop, i = False, None, 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        i += 1
        if line.lstrip().startswith("```"):
            fenced, loop = not fenced, None
            prose.append("")
            continue
        if not fenced:
            prose.append(line)
            continue
        # a code line: its `\` continuations joined; a for loop's body once per value of its variable
        while line.rstrip().endswith("\\") and i < len(lines):
            prose.append("")
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        prose.append("")
        head = LOOP.match(line)
        if head:
            loop = (head.group(1), shlex.split(head.group(2)))
        elif line.strip() == "done":
            loop = None
        elif loop and "$" + loop[0] in line:
            found += [(start, re.sub(r"\$" + loop[0] + r"\b", lambda m: value, line)) for value in loop[1]]
        else:
            found.append((start, line))
    # the spans of the prose (code lines blanked, so that line numbers hold)
    joined = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", joined):
        found.append((joined.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return found


def words(text):
    """A command's words as the shell splits them, up to a `# comment` or a shell operator."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out = []
    for word in lex:
        if word and set(word) <= set("();<>|&"):                       # &&, |, ;, >, a subshell's (
            break
        out.append(word)
    return out


def printed_commands():
    """(document, line, program, argv, text, skip reason or None) of every command the documents print."""
    found = []
    for doc in DOCS:
        for line, text in snippets(read(doc)):
            for m in PROGRAM.finditer(text):
                command = text[m.start():]
                argv = [PLACEHOLDERS.get(w, w) for w in words(command)[2:]]
                skip = None
                if any("..." in w for w in argv):
                    skip = "elided with ..."
                elif any(name in " ".join(argv) for name in EXERCISE_NAMES):
                    skip = "an exercise's flag or task"
                elif " ".join(command.split()) in MENTIONS:
                    skip = "a mention"
                found.append((doc, line, m.group(1), argv, command, skip))
    return found


COMMANDS = printed_commands()


def parsed(where, parse, argv):
    """parse(argv), its console captured; an exit (an `error:` line, via data.fail) fails the test, naming the
    document, its line, the command and what the parser said."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit as e:
        code = e.code
    pytest.fail(f"{where}\n  exit {code}: {(err.getvalue() + out.getvalue()).strip()}", pytrace=False)


@pytest.mark.parametrize("doc, line, program, argv", [c[:4] for c in COMMANDS if c[5] is None],
                         ids=[f"{c[0]}:{c[1]}" for c in COMMANDS if c[5] is None])
def test_printed_command_parses(doc, line, program, argv):
    where = f"{doc}:{line}: python {program} {shlex.join(argv)}"
    # --help prints the help and exits 0
    if "--help" in argv:
        parse = {"train.py": train.parse_args, "model.py": model.parse_args,
                 "research/experiments.py": experiments.parse_args}[program]
        with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(io.StringIO()):
            parse(argv)
        assert e.value.code == 0, where
        return
    if program == "train.py":
        parsed(where, train.parse_args, argv)
    if program == "model.py":
        parsed(where, model.parse_args, argv)
    # a grid: --dry-run appended at the end is still the grid's; --extra's flags are train.py's
    if program == "research/experiments.py":
        a = parsed(where, experiments.parse_args, argv + ["--dry-run"])
        assert a.dry_run, f"{where}\n  --dry-run appended at the end did not reach the grid"
        parsed(where + f"\n  (its --extra: {shlex.join(a.extra)})", train.parse_args, a.extra)


def test_the_documents_print_commands():
    """The reader finds the commands: some of each program, the lab loop and the for loops among them; a
    skipped command is a mention, an elision or an exercise's, nothing else."""
    programs = [c[2] for c in COMMANDS if c[5] is None]
    assert {p: programs.count(p) >= 3 for p in set(programs)} == \
        {"train.py": True, "model.py": True, "research/experiments.py": True}
    texts = [" ".join(c[3]) for c in COMMANDS if c[5] is None]
    assert any("--extra=--window 2" in t and "--base" in t for t in texts)          # exercises.md's loop
    assert sum("--attn-dropout standard" in t and "cola" in t for t in texts) == 1   # README's for m in ...
    assert sum("--out out/lra-$(echo --attention hst --sar 0" in t for t in texts) == 1
    assert not any("$m" in t for t in texts)


def test_skips_are_current():
    """Every entry of MENTIONS is printed somewhere and names subcommands and grids that exist; every name of
    EXERCISE_NAMES is in its exercise of docs/exercises.md (the one that asks the student to add it)."""
    mentioned = {" ".join(c[4].split()) for c in COMMANDS if c[5] == "a mention"}
    assert mentioned == set(MENTIONS)
    model_subcommands = next(a.choices for a in model.make_parser()._actions if not a.option_strings)
    for text, names in MENTIONS.items():
        known = model_subcommands if "model.py" in text else experiments.EXPERIMENTS
        assert [n for n in names if n not in known] == [], text
    sections = {part.split(".")[0]: part for part in read("docs/exercises.md").split("\n## ")}
    for name, exercise in EXERCISE_NAMES.items():
        assert name in sections[exercise.split()[1]], (name, exercise)


# -----------------------------------------------------------------------------
# The lab loop of docs/exercises.md ("Measure your change in the lab") through the command line

def lab_loop():
    """The loop's command as docs/exercises.md prints it (continuations joined)."""
    loops = [c[4] for c in COMMANDS if c[0] == "docs/exercises.md" and c[2] == "research/experiments.py"
             and "--base" in c[3]]
    assert len(loops) == 1, loops
    return loops[0]


def runs_started(folder):
    """What a run leaves in the grid's --out: run folders with a log or final.json, and the runs' console logs."""
    return [os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files
            if f in ("final.json", "log.jsonl") or f.endswith(".log")]


def test_the_lab_loop_with_dry_run_at_its_end_runs_nothing(tmp_path):
    """The printed loop, --out moved to a test folder and --dry-run appended at the end, through a shell: its
    runs' commands (train.py with --window 2 in place of the lab's --window 1, one per seed of the row) and no
    run."""
    command = lab_loop().replace("python ", shlex.quote(sys.executable) + " ", 1)
    out = str(tmp_path / "mine")
    done = subprocess.run(["bash", "-c", f"{command} --out {shlex.quote(out)} --dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    planned = [line for line in done.stdout.splitlines() if line.startswith("$ ")]
    assert len(planned) == len(experiments.LAB_SEEDS["lab-reach"])
    script = " " + os.path.join(ROOT, "train.py") + " "
    assert all(script in p and " --out " + out + "/" in p and one_window_2(p) for p in planned), planned
    assert runs_started(out) == []


def one_window_2(command):
    """The command gives --window once, and 2."""
    words = shlex.split(command)
    return words.count("--window") == 1 and words[words.index("--window") + 1] == "2"


def test_dry_run_before_extra_runs_nothing(tmp_path, capfd, monkeypatch):
    """--dry-run before --extra, the loop's other flags after it: the same plan, no run."""
    monkeypatch.chdir(ROOT)
    out = str(tmp_path / "mine")
    argv = ["lab", "--variants", "reach-sparse-g0", "--dry-run", "--extra=--window 2", "--out", out,
            "--base", "docs/results/results_lab.json"]
    experiments.main(argv)
    planned = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    assert len(planned) == len(experiments.LAB_SEEDS["lab-reach"])
    assert all(one_window_2(p) and " --out " + out + "/" in p for p in planned), planned
    assert runs_started(out) == []


@pytest.mark.parametrize("extra, says", [
    ("--window 2 --no-such-flag 3", "error: --extra: unrecognized train.py flag(s) --no-such-flag 3"),
    ("--attention diagonal", "error: --extra: argument --attention: invalid choice: 'diagonal'"),
    ("--window 2 --out elsewhere", "error: --extra: --out: set by the grid for each run"),
], ids=["unknown-flag", "bad-value", "grid-flag"])
def test_a_wrong_extra_is_one_error_line(tmp_path, capfd, monkeypatch, extra, says):
    """A flag train.py does not know, a bad value, a flag the grid sets: one error line naming --extra,
    before any data is made or a run starts (under --dry-run and without it)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "mine"
    for dry in ([], ["--dry-run"]):
        with pytest.raises(SystemExit) as e:
            experiments.main(["lab", "--variants", "reach-sparse-g0", f"--extra={extra}", "--out", str(out), *dry])
        err = capfd.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(says), err
        assert not out.exists()


def test_the_old_extra_form_is_one_error_line(capfd):
    """train.py's flags after a bare --extra (the form before issue 51): one error line showing the new one."""
    with pytest.raises(SystemExit):
        experiments.parse_args(["lab", "--variants", "reach-sparse-g0", "--extra", "--window", "2", "--dry-run"])
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ['error: --extra takes train.py\'s flags as one string, written with "=": --extra="--window 2"']


@pytest.mark.parametrize("content, says", [
    ('{"a": 1}', "not a lab.json"),
    ('{"runs": [{"row": "reach-hst-g0"}]}', "not a lab.json"),
    ('{"task": "lab-reach", "acc": 0.5, "dev_splits": {}}', "not a lab.json"),       # a final.json
    ("| row | measure |", "not JSON"),
], ids=["other-json", "runs-without-fields", "final-json", "markdown"])
def test_base_that_is_no_lab_json_is_one_error_line(tmp_path, capfd, content, says):
    """--base given a JSON file that is no lab.json, or no JSON at all: one error line naming --base and what
    it takes, before anything runs."""
    base = tmp_path / "base.json"
    base.write_text(content)
    out = tmp_path / "mine"
    with pytest.raises(SystemExit) as e:
        experiments.main(["lab", "--variants", "reach-sparse-g0", "--extra=--window 2", "--out", str(out),
                          "--base", str(base), "--dry-run"])
    err = capfd.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --base {base}: {says}") and "docs/results/results_lab.json" in err[0]
    assert not out.exists()

"""Failure modes through the command lines (README, "Failure modes handled"): every bad input or fault ends in
one `error:` line on stderr (exit 2; a stop by a signal 130 / 143), never a traceback, and files that existed
before are byte-identical after.

Each test is one class of failure. Starting Python and torch takes seconds, so where a class has several cases
they run in one process (run_cli: the script run as __main__ once per argv, exactly as `python SCRIPT ARGS`
would run it); signals, locks and resource limits need processes of their own.
Run: python -m pytest tests/test_failures.py -q
"""
import contextlib
import hashlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

import data
import train
from readers import lra, qa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--init", "scratch", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--attention", "dense",
        "--attn-dropout", "standard", "--sar", "0", "--device", "cpu"]

# runs SCRIPT as __main__ once per argv in one process; after each run, its exit code on a marker line
DRIVER = r"""
import json, runpy, sys
script, argvs = sys.argv[1], json.loads(sys.argv[2])
for argv in argvs:
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    print(f"@@exit {code}", file=sys.stderr, flush=True)
"""


def run_cli(script, argvs):
    """[(exit code, stderr lines)] of `python SCRIPT ARGV` for each argv, in one process. A traceback ends the
    process early: the assertion shows it."""
    p = subprocess.run([sys.executable, "-c", DRIVER, script, json.dumps([[str(a) for a in v] for v in argvs])],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    out, lines = [], []
    for line in p.stderr.splitlines():
        if line.startswith("@@exit "):
            out.append((int(line.split()[1]), lines))
            lines = []
        elif line.strip():
            lines.append(line)
    assert len(out) == len(argvs), p.stderr[-3000:]
    return out


def run_main(argv):
    """train.main in-process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main([str(a) for a in argv])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def one_error(result, *names):
    """Exit 2 and exactly one stderr line, an `error:` that names every one of `names`."""
    code, lines = result
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result
    for name in names:
        assert name in lines[0], (name, lines[0])


def snapshot(folder):
    """{file: md5} of everything in a folder, to show that a failed command left it byte-identical."""
    return {f: hashlib.md5(open(os.path.join(folder, f), "rb").read()).hexdigest() for f in sorted(os.listdir(folder))}


def listops_args(folder, out, steps=2):
    return ["--task", "listops", "--data", folder, "--out", str(out), "--max-steps", str(steps), "--batch-size", "8",
            "--save-every", "1", *TINY]


@pytest.fixture(scope="module")
def finished_run(listops_dir, tmp_path_factory):
    """A finished run (checkpoints, log, final.json) that the tests below must leave as it is."""
    out = tmp_path_factory.mktemp("runs") / "done"
    train.main(listops_args(listops_dir, out))          # returns (no SystemExit) when the run finishes
    return str(out)


# -----------------------------------------------------------------------------
# flags

def test_values_that_mean_nothing_fail_before_anything_is_written(listops_dir, tmp_path):
    """Each value is refused up front with its flag named, and no --out folder is made: the ones that used to
    fail only after training (--eval-shift, --log-every) or run silently (--epochs 0, --sar -1) included."""
    out = tmp_path / "never"
    cases = [(["--gnet-lr", "-1"], "--gnet-lr"), (["--epochs", "0"], "--epochs"), (["--sar", "-1"], "--sar"),
             (["--layers", "0"], "--layers"), (["--grad-accum", "0"], "--grad-accum"), (["--max-len", "0"], "--max-len"),
             (["--device", "gpu"], "--device gpu"), (["--schedule", "nosuch.jsonl"], "nosuch.jsonl"),
             (["--task", "foo"], "invalid choice"), (["--eval-shift=-2"], "--eval-shift"), (["--log-every", "0"], "--log-every"),
             (["--lr", "nan"], "--lr"), (["--epochs", "x"], "--epochs"), (["--no-such-flag"], "--no-such-flag")]
    base = ["--task", "listops", "--data", listops_dir, "--out", out, *TINY]          # --epochs: no --max-steps
    for (_, name), result in zip(cases, run_cli("train.py", [base + flags for flags, _ in cases])):
        one_error(result, name)
    assert not out.exists()


def test_flags_without_effect_are_a_warning(listops_dir, tmp_path):
    cases = [(["--schedule", "linear:0.1:0.2"], "--schedule: no effect"), (["--label-col", "2"], "--label-col: no effect"),
             (["--gnet-tau", "0.3"], "--gnet-tau: no effect")]
    results = run_cli("train.py", [listops_args(listops_dir, tmp_path / str(i)) + flags for i, (flags, _) in enumerate(cases)])
    for (_, what), (code, lines) in zip(cases, results):
        assert code == 0 and len(lines) == 1 and lines[0].startswith("warning: ") and what in lines[0], lines


def test_other_entry_points_check_their_flags(tmp_path):
    one_error(run_cli("research/experiments.py", [["listops", "--threads", "0"]])[0], "--threads")
    for result, name in zip(run_cli("research/bench.py", [["--rounds", "0"], ["--only", "nosuch"],
                                                 ["--json", str(tmp_path / "no" / "bench.json")]]),
                            ("--rounds", "nosuch", "--json")):
        one_error(result, name)


# -----------------------------------------------------------------------------
# nothing saved is lost

def test_failed_runs_leave_a_finished_run_as_it_was(finished_run, listops_dir, tmp_path):
    """--overwrite clears the old run only once the new one has its data and model: a malformed row or a
    flag combination that fails at model building leaves every old file byte-identical. So do a second run
    without --overwrite and convert / export pointed at the run's checkpoint."""
    before = snapshot(finished_run)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "basic_train.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n( [MIN 1 2 ] )\n")
    (bad / "basic_val.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n")
    args = listops_args(listops_dir, finished_run)
    results = run_cli("train.py", [args + ["--overwrite", "--data", bad],
                                   args + ["--overwrite", "--attn-dropout", "scheduled"],
                                   args])
    one_error(results[0], "basic_train.tsv:3")
    one_error(results[1], "scheduled")
    one_error(results[2], "holds another run")
    ckpt = os.path.join(finished_run, "ckpt_last.pt")
    results = run_cli("model.py", [["export", ckpt, ckpt], ["convert", finished_run, ckpt]])
    for result in results:
        one_error(result, "ckpt_last.pt", "which this command reads")
    assert snapshot(finished_run) == before


def test_convert_and_export_outputs(finished_run, tmp_path):
    """convert / export refuse an existing output (unless --force), a folder, a missing parent folder."""
    ckpt = os.path.join(finished_run, "ckpt_last.pt")
    taken = tmp_path / "taken.pt"
    taken.write_bytes(b"precious")
    results = run_cli("model.py", [["export", ckpt, taken], ["export", ckpt, tmp_path],
                                   ["export", ckpt, tmp_path / "no" / "x.pt"], ["export", ckpt, taken, "--force"]])
    one_error(results[0], str(taken), "--force")
    one_error(results[1], str(tmp_path), "is a folder")
    one_error(results[2], str(tmp_path / "no"))
    assert results[3][0] == 0 and torch.load(taken, weights_only=True)["format"] == "attnreg-v1"


def small_files():
    """In the child process: files stop growing at 20 kB, as on a full disk (the write fails, no SIGXFSZ kill)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_failed_save_removes_its_temp_file(finished_run, listops_dir, tmp_path):
    """A checkpoint write that fails (a full disk) is one line naming the file, and neither the half-written
    temp file nor a partial output stays behind: model.py export, and train.py's ckpt_last.pt."""
    out = tmp_path / "small.pt"
    run = tmp_path / "run"
    for argv, culprit in ((["model.py", "export", os.path.join(finished_run, "ckpt_last.pt"), out], out),
                          (["train.py", *listops_args(listops_dir, run)], run / "ckpt_last.pt")):
        p = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=300, preexec_fn=small_files)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert lines[0].startswith(f"error: {culprit}: could not write the checkpoint"), lines
    assert sorted(os.listdir(tmp_path)) == ["run"] and "ckpt_last.pt" not in " ".join(os.listdir(run))


def test_resume_refuses_another_data_stream(finished_run, listops_dir, tmp_path):
    """The saved position in the epoch means something only for the same data, batch size, seed, length and
    schedule: each change is refused, naming the flag; a checkpoint without a run state is named too."""
    before = snapshot(finished_run)
    other = tmp_path / "other"
    data.write_listops(str(other), 64, 16, 4, min_len=5, max_len=30, seed=1, max_depth=3, max_args=3)
    resume = ["--resume", "--out", finished_run]
    cases = [(["--batch-size", "16"], "--batch-size 16"), (["--seed", "3"], "--seed 3"), (["--max-len", "20"], "--max-len 20"),
             (["--data", other], "--data"), (["--grad-accum", "2"], "--grad-accum 2"), (["--epochs", "5"], "--epochs 5")]
    for (_, name), result in zip(cases, run_cli("train.py", [resume + flags for flags, _ in cases])):
        one_error(result, name, "differs from the run's")
    assert snapshot(finished_run) == before


def test_sigterm_saves_and_exits_143(listops_dir, tmp_path):
    """SIGTERM stops the run after saving, with exit 143 (Ctrl-C: 130, tests/test_reliability.py)."""
    out = tmp_path / "busy"
    p = subprocess.Popen([sys.executable, "train.py", *listops_args(listops_dir, out, steps=100000), "--save-every", "0"],
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not os.path.exists(out / "log.jsonl"):
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 143 and "Traceback" not in stderr, stderr
    assert "stopped at step" in stdout and (out / "ckpt_last.pt").exists()


# -----------------------------------------------------------------------------
# one run at a time in a --out folder

LOCK_HOLDER = "import sys, time, data; f = data.lock_out(sys.argv[1]); print('locked', flush=True); time.sleep(600)"


def hold_lock(folder):
    """A process that holds FOLDER's lock (data.lock_out, as train.py takes it) until it is killed."""
    p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(folder)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked", p.communicate()
    return p


def test_a_busy_out_is_refused_by_name_and_a_killed_run_leaves_no_lock(listops_dir, tmp_path):
    """While a run writes --out, a second run there is refused in one line naming the folder and the first run's
    pid: with --resume, with --overwrite, and a new run into a folder whose run has not written a file yet. A run
    killed by SIGKILL leaves OUT/.lock behind but no lock: the next run proceeds."""
    out, fresh = tmp_path / "busy", tmp_path / "fresh"
    first = subprocess.Popen([sys.executable, "train.py", *listops_args(listops_dir, out, steps=100000)], cwd=ROOT,
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fresh.mkdir()
    holder = hold_lock(fresh)                            # a run that holds its --out before writing anything
    try:
        deadline = time.time() + 120
        while not (out / "ckpt_last.pt").exists():       # the first run is training (--save-every 1)
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        with pytest.raises(data.DataError, match=rf"another run is using it \(pid {first.pid}\)"):
            data.lock_out(out)
        results = run_cli("train.py", [["--resume", "--out", out], listops_args(listops_dir, out) + ["--overwrite"],
                                       listops_args(listops_dir, fresh)])
        busy = f"another run is using it (pid {first.pid}); wait for it or choose another --out"
        one_error(results[0], f"--out {out}: {busy}")
        one_error(results[1], f"--out {out}: {busy}")
        one_error(results[2], f"--out {fresh}: another run is using it (pid {holder.pid})")
    finally:
        for p in (first, holder):
            p.send_signal(signal.SIGKILL)
            p.wait()
    assert (out / ".lock").read_text().strip() == str(first.pid)       # the file stays; the lock went with the run
    code, _, err = run_main(listops_args(listops_dir, out) + ["--overwrite"])
    assert code == 0, err
    assert (out / ".lock").read_text().strip() == str(os.getpid()) and (out / "final.json").exists()
    data.lock_out(fresh).close()                         # the killed holder's lock is gone too


# -----------------------------------------------------------------------------
# broken checkpoints and tokenizers

def make_hf_folder(folder):
    """A tiny BERT in the HF layout, with a WordPiece vocab.txt."""
    import transformers
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    transformers.BertForMaskedLM(cfg).save_pretrained(folder)
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmno"]) + "\n")
    return str(folder)


def test_broken_checkpoints_and_tokenizers_are_named(finished_run, tmp_path):
    ok = make_hf_folder(tmp_path / "ok")
    broken = {}
    for name, change in [("no_tokenizer", lambda d: os.remove(os.path.join(d, "vocab.txt"))),
                         ("cut_tokenizer", lambda d: open(os.path.join(d, "tokenizer.json"), "w").write('{"version": "1.0", "tr')),
                         ("bad_json", lambda d: open(os.path.join(d, "config.json"), "w").write('{"model_type": "bert",\n oops')),
                         ("no_vocab_size", lambda d: json.dump({"model_type": "bert"}, open(os.path.join(d, "config.json"), "w"))),
                         ("random_weights", lambda d: open(os.path.join(d, "model.safetensors"), "wb").write(os.urandom(4000)))]:
        d = tmp_path / name
        d.mkdir()
        for f in os.listdir(ok):
            (d / f).write_bytes(open(os.path.join(ok, f), "rb").read())
        change(str(d))
        broken[name] = str(d)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(open(os.path.join(finished_run, "ckpt_last.pt"), "rb").read()[:5000])
    cases = [(["convert", broken["no_tokenizer"], tmp_path / "a.pt"], ["no_tokenizer", "no usable tokenizer"]),
             (["convert", broken["cut_tokenizer"], tmp_path / "b.pt"], ["tokenizer.json", "damaged"]),
             (["convert", broken["bad_json"], tmp_path / "c.pt"], ["config.json:2", "invalid JSON"]),
             (["convert", broken["no_vocab_size"], tmp_path / "d.pt"], ["config.json", "vocab_size"]),
             (["convert", broken["random_weights"], tmp_path / "e.pt"], ["model.safetensors", "corrupt"]),
             (["info", cut], [str(cut), "truncated or corrupt"])]
    for (_, names), result in zip(cases, run_cli("model.py", [argv for argv, _ in cases])):
        one_error(result, *names)
    assert sorted(os.listdir(tmp_path)) == sorted(["cut.pt", "ok", *broken])       # nothing written

    # train.py: --init without tokenizer files; --resume from a model that is not a training checkpoint
    ckpt = torch.load(os.path.join(finished_run, "ckpt_last.pt"), weights_only=True)
    model_only = {k: ckpt[k] for k in ("format", "config", "model")}
    torch.save({**model_only, "tokenizer": {"files": {}}}, tmp_path / "no_tok.pt")
    (tmp_path / "run").mkdir()
    torch.save({**model_only, "tokenizer": ckpt["tokenizer"]}, tmp_path / "run" / "ckpt_last.pt")
    results = run_cli("train.py", [["--init", tmp_path / "no_tok.pt", "--out", tmp_path / "a"],
                                   ["--resume", "--out", tmp_path / "run"]])
    one_error(results[0], "no_tok.pt", "no tokenizer files")
    one_error(results[1], "ckpt_last.pt", "not a training checkpoint")


# -----------------------------------------------------------------------------
# data is what the file says

def test_labelled_files_are_read_as_written(tmp_path):
    """A JSONL line that is not an object names its line; a JSONL label that is null, an object or of another
    type than line 1's (1, 1.0, "1", true) names file and line; a file that is not UTF-8 names file and line;
    a column beyond the line says which and how many."""
    good = [json.dumps({"text": f"a cat number {i}", "label": i % 2}) for i in range(8)]
    argvs = []
    jsonl = {"bare": '"a bare string"', "null": '{"text": "a dog", "label": null}',
             "object": '{"text": "a dog", "label": {"y": 1}}', "string": '{"text": "a dog", "label": "1"}',
             "float": '{"text": "a dog", "label": 1.0}', "bool": '{"text": "a dog", "label": true}'}
    for name, line in jsonl.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text("\n".join(good + [line]) + "\n")
        (tmp_path / name / "dev.jsonl").write_text("\n".join(good) + "\n")
        argvs.append(["--task", "tsv", "--data", tmp_path / name, "--text-col", "text", "--label-col", "label"])
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "train.tsv").write_bytes(b"label\ttext\n1\ta cat\n0\tun caf\xe9\n")
    (latin / "dev.tsv").write_bytes(b"label\ttext\n1\ta cat\n")
    argvs.append(["--task", "tsv", "--data", latin, "--text-col", "text", "--label-col", "label"])
    cols = tmp_path / "cols"
    cols.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (cols / name).write_text("1\ta cat\n0\ta dog\n")
    argvs.append(["--task", "tsv", "--data", cols, "--text-col", "1", "--label-col", "5"])
    argvs.append(["--task", "tsv", "--data", cols, "--text-col", "-1", "--label-col", "0"])
    argvs.append(["--task", "tsv", "--data", cols])                                   # no columns given
    results = run_cli("train.py", [a + ["--out", tmp_path / "out", *TINY] for a in argvs])
    one_error(results[0], "bare/train.jsonl:9")
    one_error(results[1], "null/train.jsonl:9", "label null is not a label")
    one_error(results[2], "object/train.jsonl:9", 'label {"y": 1} is not a label')
    one_error(results[3], "string/train.jsonl:9", 'label "1" is a string', "line 1's label 0 is an integer")
    one_error(results[4], "float/train.jsonl:9", "label 1.0 is a decimal number", "line 1's")
    one_error(results[5], "bool/train.jsonl:9", "label true is true / false", "line 1's")
    one_error(results[6], "train.tsv:3", "not UTF-8")
    one_error(results[7], "train.tsv:1", "--label-col asks for column 5", "has 2 columns")
    one_error(results[8], "--text-col -1")
    one_error(results[9], "train.tsv", "--text-col and --label-col")


def write_squad(path, qas, context="The cat sat on the mat.  "):
    with open(path, "w") as f:
        json.dump({"data": [{"paragraphs": [{"context": context, "qas": qas}]}]}, f, indent=1)


def test_squad_answers_are_checked_against_their_context(tmp_path):
    """An answer must be its context's text at an integer answer_start; a question without answers is an
    error unless SQuAD 2.0 marks it impossible (then it is skipped and reported with its line)."""
    tok = data.tokenizer_from_path(make_hf_folder(tmp_path / "tok"))
    q = {"id": "q1", "question": "where?", "answers": [{"text": "the mat", "answer_start": 15}]}
    cases = {"wrong_text": ([{**q, "answers": [{"text": "the hat", "answer_start": 15}]}], "does not match"),
             "fractional": ([{**q, "answers": [{"text": "the mat", "answer_start": 15.5}]}], "not an integer"),
             "whitespace": ([{**q, "answers": [{"text": "  ", "answer_start": 23}]}], "non-empty"),
             "no_answers": ([{**q, "answers": []}], "no answers"),
             "qas_type": ("not a list", "expected a list of objects")}
    for name, (qas, what) in cases.items():
        d = tmp_path / name
        d.mkdir()
        write_squad(d / "train.json", qas)
        write_squad(d / "dev.json", [q])
        with pytest.raises(data.DataError, match=what) as e:
            qa.load_task("squad", str(d), tok, max_len=64)
        assert os.path.join(name, "train.json") in str(e.value)
    v2 = tmp_path / "v2"
    v2.mkdir()
    write_squad(v2 / "train.json", [q, {"id": "q2", "question": "why?", "answers": [], "is_impossible": True}])
    write_squad(v2 / "dev.json", [q])
    task = qa.load_task("squad", str(v2), tok, max_len=64)
    line = [s.strip() for s in (v2 / "train.json").read_text().split("\n")].index('"id": "q2",') + 1   # q2's line
    assert task.skipped == [f"{v2 / 'train.json'}:{line}"]


def test_skipped_rows_are_reported(tmp_path):
    """QQP's rows with missing columns are skipped, as transformers does, and reported in one warning line with
    the count and the first line numbers."""
    d = tmp_path / "qqp"
    d.mkdir()
    rows = ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"]
    rows += [f"{i}\t1\t2\tis {i} a b\tis {i} c d\t{i % 2}" for i in range(8)] + ["99\t3\tbroken"] * 7
    for name in ("train.tsv", "dev.tsv"):
        (d / name).write_text("\n".join(rows) + "\n")
    [(code, lines)] = run_cli("train.py", [["--task", "qqp", "--data", d, "--vocab-size", "20", "--max-steps", "1",
                                           "--batch-size", "4", "--out", tmp_path / "out", *TINY]])
    warnings = [line for line in lines if "skipped" in line]
    assert code == 0 and len(warnings) == 1, lines
    assert warnings[0].startswith(f"warning: 14 rows skipped: {d / 'train.tsv'}:10, {d / 'train.tsv'}:11")
    assert warnings[0].endswith("(9 more)")


# -----------------------------------------------------------------------------
# LRA lengths

def test_lra_text_keeps_4000_bytes_at_the_default(tmp_path):
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            os.makedirs(tmp_path / split / label)
            (tmp_path / split / label / "0_1.txt").write_text("ab" * 2500)                  # 5,000 bytes
    max_len = data.TASKS["lra-text"].max_len
    task = lra.load_task("lra-text", str(tmp_path), data.ByteTokenizer(), max_len=max_len)
    ids = task.train[0].ids
    assert len(ids) == 4001 and ids[0] == data.ByteTokenizer().cls_id                    # [cls] on top
    assert data.ByteTokenizer().decode(ids) == ("ab" * 2500)[:4000]
    assert data.TASKS["lra-retrieval"].max_len == 4001

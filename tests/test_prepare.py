"""``hookloop prepare`` with real tokenizers on real local text, the sidecars ``TokenDataset`` reads,
and the model-vocabulary check of ``hookloop check`` / ``hookloop train``.

Tokenizers are trained here on Python's bundled documentation (a fraction of a second); nothing is
downloaded. Subprocess runs are the real ``hookloop`` command.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hookloop.cli import main as hookloop_main
from hookloop.engine.data import (
    TokenDataset,
    prepare_tokens,
    read_token_metadata,
    stdlib_docs_topics,
    stdlib_source_files,
    token_file_vocab_size,
)
from hookloop.engine.data.prepare import prepare_command
from hookloop.engine.data.text_files import documents_from_texts
from hookloop.engine.data.tokenizer import load_tokenizer, token_dtype, train_bpe_tokenizer
from hookloop.engine.errors import ConfigError
from tests.dist_utils import REPO, run_process

EXAMPLE = REPO / "examples" / "configs" / "gpt_bpe.yaml"
EOS = "<|endoftext|>"


def hookloop(
    *args: str, cwd: Path, env: dict | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-m", "hookloop", *args], cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A 512-id byte-level BPE trained on the bundled documentation, saved as a directory."""
    directory = tmp_path_factory.mktemp("bpe") / "bpe_512"
    docs = documents_from_texts(stdlib_docs_topics())
    train_bpe_tokenizer([docs["text"]], directory, 512)
    return directory


def documents_of(path: Path, tokenizer_path: Path) -> list[str]:
    """Decode a token file back into its documents: split after every eos id."""
    meta = read_token_metadata(path)
    ids = np.fromfile(path, dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    assert ids[-1] == meta["eos_id"], "every document, the last one too, ends with eos"
    ends = np.flatnonzero(ids == meta["eos_id"])
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


def run_prepare(capsys, *args) -> tuple[int, str, str]:
    code = prepare_command([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# -------------------------------------------------------------------------------- imports


def test_importing_hookloop_loads_no_tokenizer_library():
    probe = (
        "import sys, hookloop, hookloop.engine.data, hookloop.engine.data.prepare\n"
        "heavy = {'datasets', 'tokenizers', 'transformers', 'pyarrow'}\n"
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))\n"
    )
    proc = run_process([sys.executable, "-c", probe], timeout=120, fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -------------------------------------------------------------------------------- the whole command


def test_train_a_bpe_then_tokenize_the_docs_nothing_left_in_home_or_beside_the_output(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    # A home with nothing in it and Hugging Face caches nobody can create (a path under a file,
    # which fails even for root): prepare must use neither.
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(blocker / "xdg"), "HF_HOME": str(blocker / "hf")}
    out = tmp_path / "data" / "docs.bin"
    args = [
        "prepare",
        str(out),
        "--from-stdlib-docs",
        "--train-tokenizer",
        str(tmp_path / "bpe"),
        "--vocab-size",
        "400",
    ]
    proc = hookloop(*args, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", "no progress bar or log noise when stderr is not a terminal"
    assert re.fullmatch(
        r"wrote \d+ tokens \(79 documents, uint16, vocabulary 400, eos 0\) to .*docs\.bin; "
        r"trained a 400-id BPE, saved to .*bpe\n",
        proc.stdout,
    ), proc.stdout
    assert list(home.iterdir()) == []
    assert sorted(p.name for p in out.parent.iterdir()) == ["docs.bin", "docs.bin.json"]

    assert documents_of(out, tmp_path / "bpe") == stdlib_docs_topics()
    meta = read_token_metadata(out)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 400 and meta["eos_id"] == 0
    assert meta["documents"] == 79 and meta["tokens"] == out.stat().st_size // 2
    assert meta["tokenizer"]["path"] == str((tmp_path / "bpe").resolve())
    assert meta["tokenizer"]["trained"]["vocab_size"] == 400
    ds = TokenDataset(out, 32)
    assert (ds.vocab_size, ds.eos_id, ds.num_tokens) == (400, 0, meta["tokens"])

    # The saved tokenizer reproduces the file; the directory is never trained over.
    again = tmp_path / "again.bin"
    assert prepare_command([str(again), "--from-stdlib-docs", "--tokenizer", str(tmp_path / "bpe")]) == 0
    assert again.read_bytes() == out.read_bytes()
    assert read_token_metadata(again)["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]
    proc = hookloop(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hookloop prepare: error: --train-tokenizer: {tmp_path / 'bpe'} already holds a tokenizer.json; "
        f"reuse it with --tokenizer {tmp_path / 'bpe'}, or name a new directory"
    ]


def test_txt_jsonl_and_parquet_documents_in_order(tmp_path, bpe, capsys):
    texts = ["A whole file.\nTwo lines, ünïcode ✓\n", "first line", "", "third", "row one", "row two"]
    (tmp_path / "a.txt").write_text(texts[0], encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w") as f:
        for i, text in enumerate(texts[1:4]):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
        f.write("\n")  # a blank line is no document
    pq.write_table(pa.table({"body": texts[4:], "n": [1, 2]}), tmp_path / "c.parquet")
    files = [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"]
    out = tmp_path / "out" / "mixed.bin"
    code, stdout, err = run_prepare(
        capsys, out, "--files", *files, "--text-field", "body", "--tokenizer", bpe
    )
    assert code == 0, err
    assert documents_of(out, bpe) == texts
    meta = read_token_metadata(out)
    assert meta["documents"] == 6 and meta["text_field"] == "body"
    assert meta["sources"] == [str(f) for f in files]
    assert sorted(p.name for p in out.parent.iterdir()) == ["mixed.bin", "mixed.bin.json"]

    # Without a tokenizer the same files are byte-level: records as UTF-8, the NUL byte between.
    byte_out = tmp_path / "bytes.u8"
    code, _, err = run_prepare(capsys, byte_out, "--files", *files, "--text-field", "body")
    assert code == 0, err
    assert byte_out.read_bytes().split(b"\x00") == [t.encode() for t in texts]
    assert read_token_metadata(byte_out)["vocab_size"] == 256


def test_two_processes_write_the_same_bytes_as_one(tmp_path, bpe, capsys):
    paths = {}
    for n in (1, 2):
        paths[n] = tmp_path / f"src{n}.bin"
        code, _, err = run_prepare(
            capsys, paths[n], "--from-stdlib-source", "--limit", "40", "--tokenizer", bpe, "--num-proc", n
        )
        assert code == 0, err
    assert paths[1].read_bytes() == paths[2].read_bytes()
    assert read_token_metadata(paths[1]) == read_token_metadata(paths[2])
    decoded = documents_of(paths[2], bpe)
    assert decoded == [f.read_text(encoding="utf-8") for f in stdlib_source_files(40)]


def word_tokenizer(path: Path, n_ids: int) -> Path:
    """A word-level tokenizer whose ids are 0..n_ids-1: ``w<i>`` is id i, eos the last id."""
    vocab = {f"w{i}": i for i in range(n_ids - 1)}
    vocab[EOS] = n_ids - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize(("n_ids", "dtype"), [(65_536, "uint16"), (65_537, "uint32")])
def test_the_dtype_is_uint16_up_to_65536_ids_then_uint32(tmp_path, capsys, n_ids, dtype):
    tokenizer = word_tokenizer(tmp_path / "words.json", n_ids)
    (tmp_path / "doc.txt").write_text(f"w1 w{n_ids - 2} w7")
    out = tmp_path / "words.bin"
    code, stdout, err = run_prepare(capsys, out, "--files", tmp_path / "doc.txt", "--tokenizer", tokenizer)
    assert code == 0, err
    meta = read_token_metadata(out)
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"]) == (dtype, n_ids, n_ids - 1)
    assert np.fromfile(out, dtype=np.dtype(dtype).newbyteorder("<")).tolist() == [1, n_ids - 2, 7, n_ids - 1]
    assert TokenDataset(out, 3)[0][1].tolist() == [n_ids - 2, 7, n_ids - 1]


def test_token_dtype_bounds():
    assert [token_dtype(n) for n in (2, 2**16, 2**16 + 1, 2**32)] == ["uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(ConfigError, match=r"^--tokenizer: has 4294967297 token ids, more than uint32"):
        token_dtype(2**32 + 1)


def test_a_tokenizer_directory_transformers_reads(tmp_path, bpe, capsys):
    # GPT-2's slow-tokenizer files (vocab.json + merges.txt) and no tokenizer.json: AutoTokenizer
    # converts them; the eos token comes from tokenizer_config.json.
    gpt2 = tmp_path / "gpt2_style"
    gpt2.mkdir()
    Tokenizer.from_file(str(bpe / "tokenizer.json")).model.save(str(gpt2))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOS, "add_prefix_space": False}
    (gpt2 / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "auto.bin"
    texts = stdlib_docs_topics()[:5]
    for i, text in enumerate(texts):
        (tmp_path / f"t{i}.txt").write_text(text)
    files = [tmp_path / f"t{i}.txt" for i in range(5)]
    code, _, err = run_prepare(capsys, out, "--files", *files, "--tokenizer", gpt2)
    assert code == 0, err
    assert read_token_metadata(out)["eos_id"] == 0
    assert documents_of(out, bpe) == texts
    reference = tmp_path / "reference.bin"
    assert run_prepare(capsys, reference, "--files", *files, "--tokenizer", bpe)[0] == 0
    assert out.read_bytes() == reference.read_bytes()


def test_a_tokenizer_without_eos_needs_eos_token(tmp_path, capsys):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "[END]": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "plain.json"))
    (tmp_path / "doc.txt").write_text("hello world")
    out = tmp_path / "out.bin"
    code, _, err = run_prepare(
        capsys, out, "--files", tmp_path / "doc.txt", "--tokenizer", tmp_path / "plain.json"
    )
    assert code == 2 and not out.exists()
    assert err.startswith(
        f"hookloop prepare: error: --tokenizer: {tmp_path / 'plain.json'} names no end-of-document"
    )
    assert "pass --eos-token TOKEN" in err and err.count("\n") == 1
    args = ["--files", tmp_path / "doc.txt", "--tokenizer", tmp_path / "plain.json", "--eos-token", "[END]"]
    assert run_prepare(capsys, out, *args)[0] == 0
    assert np.fromfile(out, dtype="<u2").tolist() == [1, 2, 3]


def write_bad_inputs(tmp: Path) -> None:
    (tmp / "ok.txt").write_text("fine")
    (tmp / "notes.md").write_text("# markdown")
    (tmp / "holes.jsonl").write_text('{"text": "a"}\n{"title": "no text"}\n')
    (tmp / "other.jsonl").write_text('{"body": "a"}\n')
    (tmp / "number.jsonl").write_text('{"text": "a"}\n{"text": 5}\n')
    pq.write_table(pa.table({"text": ["x", None]}), tmp / "holes.parquet")
    (tmp / "broken.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "not_a_tokenizer.json").write_text('{"hello": 1}')
    (tmp / "empty_dir").mkdir()


BAD_INPUTS = [
    (["--files", "missing.txt"], "--files: missing.txt does not exist"),
    (["--files", "notes.md"], "--files: notes.md has an unknown extension '.md'"),
    (["--files", "holes.jsonl"], "--text-field: line 2 of holes.jsonl holds nothing in 'text', not a string"),
    (
        ["--files", "number.jsonl"],
        "--text-field: line 2 of number.jsonl holds 5 (int) in 'text', not a string",
    ),
    (
        ["--files", "other.jsonl"],
        "--text-field: no record of other.jsonl has a field 'text' (its fields: body)",
    ),
    (["--files", "holes.parquet"], "--text-field: row 2 of holes.parquet holds nothing in 'text'"),
    (["--files", "ok.txt", "broken.jsonl"], "--files: cannot read broken.jsonl as JSON lines (line 2 is not"),
    (["--files", "ok.txt", "latin1.txt"], "--files: cannot read latin1.txt as UTF-8 text"),
    (["--files", "empty.jsonl"], "--files: hold no document (empty files)"),
    (["--files", "ok.txt", "--tokenizer", "nothing_here"], "--tokenizer: nothing_here does not exist"),
    (
        ["--files", "ok.txt", "--tokenizer", "not_a_tokenizer.json"],
        "--tokenizer: not_a_tokenizer.json is not a",
    ),
    (
        ["--files", "ok.txt", "--tokenizer", "empty_dir"],
        "--tokenizer: empty_dir is not a tokenizer directory",
    ),
    (
        ["--files", "ok.txt", "--train-tokenizer", "t", "--vocab-size", "100"],
        "--vocab-size: must be an integer >= 257",
    ),
    (["--files", "ok.txt", "--train-tokenizer", "t"], "--vocab-size: is required with --train-tokenizer"),
    (
        ["--files", "ok.txt", "--num-proc", "0", "--train-tokenizer", "t", "--vocab-size", "300"],
        "--num-proc: must be",
    ),
    (
        ["--files", "ok.txt", "--dtype", "uint16", "--tokenizer", "x"],
        "--dtype: only applies to byte-level files",
    ),
]


@pytest.mark.parametrize(
    ("args", "message"), BAD_INPUTS, ids=[f"{m.split(':')[0]}-{i}" for i, (_, m) in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_one_line_naming_the_argument(tmp_path, bpe, capsys, monkeypatch, args, message):
    write_bad_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    if "--tokenizer" not in args and "--train-tokenizer" not in args:
        args = [*args, "--tokenizer", str(bpe)]
    before = set(tmp_path.iterdir())
    code, out, err = run_prepare(capsys, "out.bin", *args)
    assert code == 2 and out == ""
    assert err.startswith(f"hookloop prepare: error: {message}"), err
    assert err.count("\n") == 1
    assert set(tmp_path.iterdir()) == before, "nothing written, no cache left behind"


def test_the_command_exits_2_with_one_line(tmp_path):
    proc = hookloop("prepare", "out.bin", "--files", "missing.jsonl", "--tokenizer", "tok.json", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "hookloop prepare: error: --files: missing.jsonl does not exist; give existing text files (.txt: one "
        "document per file; .jsonl: one document per line, its text in --text-field; .parquet: one document "
        "per row, its text in --text-field)"
    ]


def listing(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` (relative path -> bytes; None for a directory)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in directory.rglob("*")
    }


@pytest.mark.parametrize("tokenizer", [False, True], ids=["byte-level", "tokenizer"])
def test_an_output_or_sidecar_that_is_a_directory_is_refused_before_any_input_is_read(
    tmp_path, bpe, tokenizer
):
    (tmp_path / "out.bin").mkdir()
    (tmp_path / "out.bin" / "mine.txt").write_text("a user's file")
    (tmp_path / "out.bin.json").write_text('{"a user\'s": "sidecar"}')
    (tmp_path / "side.bin.json").mkdir()
    before = listing(tmp_path)
    with_tokenizer = ["--tokenizer", str(bpe)] if tokenizer else []
    for out, said in (
        ("out.bin", "OUT: out.bin is a directory; name the token file to write (its sidecar: out.bin.json)"),
        ("side.bin", "OUT: its sidecar side.bin.json is a directory; move it or name another token file"),
    ):
        # missing.txt would be refused as --files if any input were read first
        proc = hookloop("prepare", out, "--files", "missing.txt", *with_tokenizer, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.splitlines() == [f"hookloop prepare: error: {said}"]
        proc = hookloop("prepare", out, "--from-stdlib-docs", *with_tokenizer, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [f"hookloop prepare: error: {said}"]
        assert listing(tmp_path) == before  # no stray sidecar, no cache, the user's files as they were


def test_the_sidecar_is_put_back_when_the_token_file_cannot_follow(tmp_path, monkeypatch):
    out = tmp_path / "docs.u8"
    prepare_tokens(["first"], out)
    sidecar = (tmp_path / "docs.u8.json").read_bytes()
    real = os.replace

    def refuse_the_token_file(src, dst):
        if not str(dst).endswith(".json"):  # the sidecar goes in, the token file cannot follow
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", refuse_the_token_file)
    with pytest.raises(OSError, match="No space left"):
        prepare_tokens(["second, longer"], out)
    assert (tmp_path / "docs.u8.json").read_bytes() == sidecar and out.read_bytes() == b"first"
    with pytest.raises(OSError, match="No space left"):
        prepare_tokens(["new"], tmp_path / "new.u8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.u8", "docs.u8.json"]  # nothing else left


@pytest.mark.parametrize(
    ("sidecar", "said"),
    [("not json", "is not readable JSON"), ("[1, 2]", "must hold a JSON object, got list")],
)
def test_a_sidecar_refused_at_training_names_the_dataset_field(tmp_path, sidecar, said):
    (tmp_path / "run.yaml").write_text(TINY)
    prepare_tokens(["some text " * 20], tmp_path / "docs.u8")
    (tmp_path / "docs.u8.json").write_text(sidecar)
    for command in ("check", "train"):
        proc = hookloop(command, "run.yaml", "data.datasets.docs=docs.u8", "train.run_dir=run", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = proc.stderr.splitlines()
        assert line.startswith("config error: data.datasets.docs: sidecar 'docs.u8.json' ") and said in line
    assert not (tmp_path / "run").exists()


def test_a_progress_bar_on_a_terminal(tmp_path, bpe):
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "hookloop",
        "prepare",
        "o.bin",
        "--from-stdlib-docs",
        "--tokenizer",
        str(bpe),
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=secondary)
    os.close(secondary)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the terminal closed: the command exited
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(primary)
    assert proc.wait(timeout=60) == 0
    assert b"tokenizing: 100%" in seen and b"79/79" in seen, seen[-500:]


# -------------------------------------------------------------------------------- sidecars


def test_old_and_new_sidecars_both_read(tmp_path, bpe, capsys):
    old = tmp_path / "old.u8"
    old.write_bytes(b"hello\x00world")
    old_meta = {"format": "hookloop-tokens", "version": 1, "tokenizer": "utf8-bytes", "dtype": "uint8"}
    old_meta.update(num_tokens=11, num_documents=2, separator=0)  # a sidecar from before vocab_size
    (tmp_path / "old.u8.json").write_text(json.dumps(old_meta))
    ds = TokenDataset(old, 4)
    assert ds.vocab_size == 256 and ds.eos_id is None and bytes(ds[0][0].tolist()) == b"hell"
    wide = tmp_path / "wide.u16"
    prepare_tokens(["a", "b"], wide, dtype="uint16", separator=300)
    meta = read_token_metadata(wide)
    assert meta["vocab_size"] == 301
    del meta["vocab_size"]
    (tmp_path / "wide.u16.json").write_text(json.dumps(meta))
    assert token_file_vocab_size(wide) == 301

    new = tmp_path / "new.bin"
    assert run_prepare(capsys, new, "--from-stdlib-docs", "--tokenizer", bpe)[0] == 0
    assert (TokenDataset(new, 16).vocab_size, TokenDataset(new, 16).dtype.name) == (512, "uint16")
    with open(new, "ab") as f:  # a file that is not what its sidecar says
        f.write(b"\x00\x00")
    with pytest.raises(ConfigError, match=r"^path: .*new\.bin' holds \d+ tokens but its sidecar says \d+"):
        TokenDataset(new, 16)


def test_load_tokenizer_from_a_file_or_its_directory(bpe):
    from_dir, from_file = load_tokenizer(bpe), load_tokenizer(bpe / "tokenizer.json")
    assert (from_dir.eos_token, from_dir.eos_id, from_dir.vocab_size) == (EOS, 0, 512)
    assert (from_file.eos_token, from_file.eos_id) == (EOS, 0)  # found among the special tokens
    assert from_dir.describe()["sha256"] == from_file.describe()["sha256"]


# -------------------------------------------------------------------------------- the vocabulary check

TINY = """
model:
  target: hookloop.models.gpt:recipe
  n_layers: 1
  d_model: 16
  n_heads: 2
train:
  seq_len: 16
  local_batch_size: 2
step_scheduler:
  global_batch_size: 2
  max_steps: 2
"""


def test_check_and_train_refuse_a_model_smaller_than_the_data(tmp_path, bpe, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(TINY)
    assert run_prepare(capsys, "docs.bin", "--from-stdlib-docs", "--tokenizer", bpe)[0] == 0
    data = ["data.datasets.docs=docs.bin", "train.run_dir=run"]
    for command in ("check", "train"):
        assert hookloop_main([command, "run.yaml", *data]) == 2
        assert capsys.readouterr().err.splitlines() == [
            "config error: model.vocab_size: 256 (the factory's default) is smaller than the data's "
            "vocabulary: data.datasets.docs (docs.bin) has 512 token ids (its sidecar's vocab_size); "
            "set model.vocab_size=512 or more"
        ]
    assert not (tmp_path / "run").exists()
    assert hookloop_main(["check", "run.yaml", *data, "model.vocab_size=512"]) == 0
    # A mixture: the largest vocabulary counts; the built-in corpora are byte-level (256).
    mixed = [*data, "data.datasets.code=stdlib_source", "model.vocab_size=300"]
    assert hookloop_main(["check", "run.yaml", *mixed]) == 2
    assert "data.datasets.docs (docs.bin) has 512 token ids" in capsys.readouterr().err
    assert hookloop_main(["check", "run.yaml", "model.vocab_size=255", "train.run_dir=run"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: model.vocab_size: 255 is smaller than the data's vocabulary: data.datasets.docs "
        "(stdlib_docs) has 256 token ids (a built-in byte-level corpus); set model.vocab_size=256 or more"
    ]


def test_a_model_without_a_vocab_size_argument_is_checked_on_the_first_microbatch(
    tmp_path, bpe, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(
        "import torch\n\ndef build(vocab: int = 64):\n    return torch.nn.Embedding(vocab, 8)\n"
    )
    (tmp_path / "run.yaml").write_text("model:\n  target: mine.py:build\nstep_scheduler:\n  max_steps: 2\n")
    assert run_prepare(capsys, "docs.bin", "--from-stdlib-docs", "--tokenizer", bpe)[0] == 0
    capsys.readouterr()
    # No vocab_size to compare with the sidecar's: the first microbatch through the model finds it.
    assert hookloop_main(["check", "run.yaml", "data.datasets.docs=docs.bin", "train.run_dir=run"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "config error: model: forward and loss on the first microbatch int64[8, 128] fail: "
    )
    assert "IndexError" in line and "does the model's vocabulary cover the data's?" in line


# -------------------------------------------------------------------------------- the example, end to end


def test_the_bpe_example_prepares_then_trains_below_the_uniform_loss(tmp_path):
    header = EXAMPLE.read_text().split("\nmodel:")[0]
    prepare = next(
        line for line in header.splitlines() if "hookloop prepare" in line and "--train-tokenizer" in line
    )
    words = shlex.split(prepare.lstrip("# "))
    assert words[:2] == ["hookloop", "prepare"]
    proc = hookloop(*words[1:], cwd=tmp_path)  # exactly the command the config's header gives
    assert proc.returncode == 0, proc.stderr
    vocab = read_token_metadata(tmp_path / "data" / "stdlib_docs_bpe.bin")["vocab_size"]
    assert vocab == 2048
    overrides = [
        "step_scheduler.max_steps=40",
        "step_scheduler.val_every_steps=20",
        "step_scheduler.ckpt_every_steps=40",
        "lr.warmup_steps=5",
        "logging.log_interval=5",
        "model.n_layers=2",
        "model.d_model=64",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    proc = hookloop("train", str(EXAMPLE), *overrides, cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    uniform = math.log(vocab)
    assert losses[-1] < uniform - 1.0 and val[-1] < uniform - 1.0, (losses, val, uniform)


def test_ctrl_c_leaves_no_token_file_cache_or_worker(tmp_path, bpe):
    # A terminal's Ctrl-C reaches the whole process group: the command and its workers.
    restore = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    out = tmp_path / "data" / "src.bin"
    args = [
        "-m",
        "hookloop",
        "prepare",
        str(out),
        "--from-stdlib-source",
        "--tokenizer",
        str(bpe),
        "--num-proc",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", restore, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        workers: list[str] = []
        while len(workers) < 2 and proc.poll() is None:  # tokenizing in two workers
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.02)
            workers = subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
            ).stdout.split()
        assert any(p.suffix == ".tmp" for p in out.parent.iterdir())
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert stderr == f"hookloop prepare: interrupted; {out} was not written\n"
    assert list(out.parent.iterdir()) == []
    assert len(workers) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_a_ctrl_c_while_the_workers_start_is_not_lost(bpe, monkeypatch):
    """A Ctrl-C that arrives while the pool forks its workers (when the main process must not let
    a worker see it) ends the run once the pool stands, with every worker gone."""
    import multiprocessing
    import threading

    from hookloop.engine.data import tokenized

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are the main thread's")
    real = tokenized._pool_context()

    class CtrlCAtStart:
        def Pool(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
            pool = real.Pool(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)
            return pool

    monkeypatch.setattr(tokenized, "_pool_context", CtrlCAtStart)
    written: list = []
    with pytest.raises(KeyboardInterrupt):
        tokenized._tokenize_in_workers(
            [["some text"]] * 8, load_tokenizer(bpe), "uint16", 2, lambda *a: written.append(a)
        )
    assert not written and not multiprocessing.active_children()


def _sigterm_is_default(texts) -> np.ndarray:
    """Run in a tokenizing worker: 1 when SIGTERM would end it whatever it is doing."""
    return np.array([signal.getsignal(signal.SIGTERM) is signal.SIG_DFL], dtype=np.uint16)


def test_tokenizing_workers_end_on_sigterm_whatever_this_process_handles_it_with(bpe, monkeypatch):
    """The pool ends its workers with SIGTERM; a handler of this process's (the test suite turns
    SIGTERM into KeyboardInterrupt, a user's program may note it) must not be a worker's: run by
    Python, it never runs in a worker stuck in C, and the pool's join would wait forever."""
    import threading

    from hookloop.engine.data import tokenized

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are the main thread's")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        monkeypatch.setattr(tokenized, "_encode_in_worker", _sigterm_is_default)
        seen: list = []
        tokenized._tokenize_in_workers(
            [["a"]] * 4, load_tokenizer(bpe), "uint16", 2, lambda ids, _: seen.append(ids)
        )
        assert [int(ids[0]) for ids in seen] == [1, 1, 1, 1]
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # this process keeps its own
    finally:
        signal.signal(signal.SIGTERM, previous)

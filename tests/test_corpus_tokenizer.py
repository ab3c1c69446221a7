"""The stdlib corpus (scripts/corpus.py) and its tokenizer (scripts/train_tokenizer.py):
which files go in, a split that never moves, and a tokenizer that round-trips source."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

import pytest

# scripts/ is not a package: its files import each other by plain module name.
_SCRIPTS_DIR = str(Path(__file__).resolve().parents[1] / "scripts")
if _SCRIPTS_DIR not in sys.path:
    sys.path.insert(0, _SCRIPTS_DIR)

from corpus import Corpus, collect, is_heldout  # noqa: E402
from train_tokenizer import SPECIAL_TOKENS, main, save, train_tokenizer  # noqa: E402

SOURCE = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"hello {name}"\n'
# Files the skip rules keep (relative path -> text), and files they must drop.
KEPT = {
    "alpha.py": SOURCE,
    "pkg/__init__.py": "",
    "pkg/beta.py": SOURCE * 3,
    "pkg/testing.py": SOURCE,  # only whole directory names are skipped, not prefixes
    "json/encoder.py": SOURCE,  # held out by the rule (pinned below)
    "typing.py": SOURCE * 2,  # held out too
    **{f"many/mod_{i:02d}.py": f"VALUE_{i} = {i}\n" + SOURCE for i in range(20)},
}
DROPPED = {
    "test/test_alpha.py": SOURCE.encode(),
    "pkg/tests/test_beta.py": SOURCE.encode(),
    "site-packages/thirdparty.py": SOURCE.encode(),
    "idlelib/editor.py": SOURCE.encode(),
    "lib2to3/fixer.py": SOURCE.encode(),
    "pkg/__pycache__/beta.py": SOURCE.encode(),
    "latin1.py": "# caf\xe9\n".encode("latin-1"),  # not valid UTF-8
    "huge.py": b"x = 1\n" * 40_000,  # 240 KB: over the 200 KB cap
    "notes.txt": SOURCE.encode(),
}
# Text a tokenizer has to carry through unchanged: tabs, CRLF, trailing spaces,
# accents, CJK, emoji, a lone combining mark, a literal special token.
ROUND_TRIP = (
    "class Café:\r\n\tdef __init__(self):  \n        self.名前 = '日本語 ☃ 🐍'\n"
    "# e\u0301 \u200b <bos> done\n\n\n    \n",
    "",
    " leading space",
    SOURCE,
)


def make_tree(root: Path) -> Path:
    for relative, text in KEPT.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text, encoding="utf-8")
    for relative, data in DROPPED.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    return root


def relative_paths(corpus: Corpus) -> list[str]:
    return [corpus.relative(p) for p in corpus.train + corpus.heldout]


def test_collect_keeps_only_small_utf8_library_sources(tmp_path):
    corpus = collect(make_tree(tmp_path))
    assert sorted(relative_paths(corpus)) == sorted(KEPT)


def test_split_follows_the_documented_sha1_rule_and_is_deterministic(tmp_path):
    corpus = collect(make_tree(tmp_path))
    for path in corpus.train + corpus.heldout:
        digest = hashlib.sha1(corpus.relative(path).encode()).digest()
        assert (path in corpus.heldout) == (int.from_bytes(digest[:4], "big") % 20 == 0)
    assert [corpus.relative(p) for p in corpus.heldout] == ["json/encoder.py", "typing.py"]
    for split in (corpus.train, corpus.heldout):
        assert [corpus.relative(p) for p in split] == sorted(corpus.relative(p) for p in split)
    assert collect(tmp_path) == corpus


def test_heldout_rule_holds_out_about_five_percent_and_is_pinned():
    share = sum(is_heldout(f"pkg{i % 7}/module_{i}.py") for i in range(4000)) / 4000
    assert 0.04 < share < 0.06
    # Pinned: a change to the rule would silently move files between splits.
    assert is_heldout("typing.py") and is_heldout("json/encoder.py")
    assert not is_heldout("os.py") and not is_heldout("json/decoder.py")


def test_manifest_records_every_file_with_size_and_hash(tmp_path):
    corpus = collect(make_tree(tmp_path / "tree"))
    corpus.write_manifest(tmp_path / "manifest.json")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest == corpus.manifest()
    assert manifest["root"] == str(corpus.root)
    assert manifest["python"] == platform.python_version()
    for split, paths in (("train", corpus.train), ("heldout", corpus.heldout)):
        entries = manifest[split]["entries"]
        assert [e["path"] for e in entries] == [corpus.relative(p) for p in paths]
        for entry in entries:
            data = KEPT[entry["path"]].encode()
            assert entry["bytes"] == len(data)
            assert entry["sha1"] == hashlib.sha1(data).hexdigest()
        assert manifest[split]["files"] == len(paths)
        assert manifest[split]["bytes"] == sum(e["bytes"] for e in entries)
    assert manifest["total"] == {
        "files": len(KEPT),
        "bytes": sum(len(t.encode()) for t in KEPT.values()),
    }


@pytest.fixture(scope="module")
def stdlib_tokenizer(tmp_path_factory):
    """A 300-token tokenizer trained on a handful of real stdlib files, and its folder."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = ("textwrap.py", "string.py", "shlex.py", "json/decoder.py", "fnmatch.py")
    corpus = Corpus(root=root, train=tuple(root / f for f in files), heldout=())
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    out_dir = tmp_path_factory.mktemp("tokenizer")
    save(tokenizer, out_dir, corpus)
    return tokenizer, out_dir


def test_special_tokens_take_ids_0_to_3_and_vocab_is_the_size_asked(stdlib_tokenizer):
    tokenizer, _ = stdlib_tokenizer
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert SPECIAL_TOKENS == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert tokenizer.get_vocab_size() == 300


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_any_source_round_trips_exactly_without_unk(stdlib_tokenizer, text):
    tokenizer, _ = stdlib_tokenizer
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert 3 not in ids  # byte-level: every byte has a token


def test_transformers_loads_the_folder_and_encodes_the_same_ids(stdlib_tokenizer):
    from transformers import AutoTokenizer

    tokenizer, out_dir = stdlib_tokenizer
    hf = AutoTokenizer.from_pretrained(out_dir)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    for text in ROUND_TRIP:
        ids = tokenizer.encode(text).ids
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == text


def test_cli_writes_a_loadable_folder_and_stops_short_of_the_vocab_on_a_tiny_tree(tmp_path, capsys):
    from tokenizers import Tokenizer

    out_dir, tree = tmp_path / "out", make_tree(tmp_path / "tree")
    main(["--corpus-root", str(tree), "--vocab-size", "1000", "--out", str(out_dir)])
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "corpus_manifest.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    # Too little text for 1000 tokens: the trainer runs out of pairs seen twice.
    assert 4 + 256 < tokenizer.get_vocab_size() < 1000
    ids = tokenizer.encode(ROUND_TRIP[0]).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == ROUND_TRIP[0]
    phases = [line for line in capsys.readouterr().err.splitlines() if line.endswith(" s")]
    assert [line.split(":")[0] for line in phases] == [
        "[train_tokenizer] collect",
        "[train_tokenizer] train",
        "[train_tokenizer] save",
        "[train_tokenizer] evaluate held out",
    ]

"""Tier 2 (CPU torch): planner.data, a text corpus as resumable batches in the model's own format."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.capture.load import ModelFile, load_model_file, model_output
from planner.data import DEFAULT_CORPUS, TOKENIZERS, TextBatches, Vocab, token_batch_format
from planner.data.batches import StepWindows, batchify
from planner.data.text import encode, read_corpus, split_point
from planner.errors import DataError, PlannerError

ROOT = Path(__file__).resolve().parents[1]
LMS = ["gpt", "encoder_lm", "shakespeare", "llama", "hf/gpt2", "hf/llama", "hf/qwen"]


def lm_example(n: int = 2, seq_len: int = 2) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """The simplest token-id LM batch: (ids,), next ids."""
    return (torch.zeros(n, seq_len, dtype=torch.long),), torch.zeros(n, seq_len, dtype=torch.long)


@pytest.fixture
def counting(tmp_path: Path) -> Path:
    """60 distinct ASCII characters '0'..'k': byte ids 48..107, so every batch is known by heart."""
    path = tmp_path / "counting.txt"
    path.write_text("".join(chr(48 + i) for i in range(60)))
    return path


def counting_batches(path: Path, **kw: Any) -> TextBatches:
    # 60 tokens: 48 train (ids 48..95), 12 eval (96..107); 4 rows of 12; T = 2: 5 steps per epoch
    args: dict[str, Any] = dict(
        example=lm_example(), vocab_size=256, global_rows=4, tokenizer="byte", eval_fraction=0.2
    )
    return TextBatches(path, **(args | kw))


def ids_of(batch: tuple[Any, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    inputs, target = batch
    return inputs[0].tolist(), target.tolist()


def draw(stream: Any, n: int) -> list[tuple[Any, torch.Tensor]]:
    return [next(stream) for _ in range(n)]


def same(a: list[tuple[Any, torch.Tensor]], b: list[tuple[Any, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[1], y[1]) and all(torch.equal(u, v) for u, v in zip(x[0], y[0])) for x, y in zip(a, b)
    )


# --- tokenizers and vocabularies ----------------------------------------------------------------


def test_tokenizer_names() -> None:
    assert TOKENIZERS == ("char", "byte", "word")


def test_word_tokenizer_follows_torchtext_basic_english_rules() -> None:
    line = 'Feed\'st thy "light"; flame: (yes)! Really? A, b.'
    ids, vocab = encode(line + "\n", "word", 100, 0.05)
    assert [vocab.tokens[i] for i in ids.tolist()] == [
        "feed", "'", "st", "thy", "light", "flame", "(", "yes", ")", "!", "really", "?", "a", ",", "b", ".", "<eos>",
    ]  # fmt: skip


def test_word_vocabulary_of_a_three_line_corpus() -> None:
    text = "The cat sat.\nThe dog sat, the cat ran!\nA cat.\n"
    # 18 tokens; 0.1 holds out floor(1.8) = 1: the last <eos>, so the train split has two <eos>
    ids, vocab = encode(text, "word", 100, 0.1)
    assert vocab.tokens == ("<unk>", "cat", "the", ".", "<eos>", "sat", "!", ",", "a", "dog", "ran")
    assert vocab.folded == 0
    assert ids.tolist() == [2, 1, 5, 3, 4, 2, 9, 5, 7, 2, 1, 10, 6, 4, 8, 1, 3, 4]
    # V = 6 keeps <unk> and the 5 most frequent (ties alphabetical); the 5 others fold into <unk>
    ids, vocab = encode(text, "word", 6, 0.1)
    assert vocab.tokens == ("<unk>", "cat", "the", ".", "<eos>", "sat")
    assert vocab.folded == 5
    assert ids.tolist() == [2, 1, 5, 3, 4, 2, 0, 5, 0, 2, 1, 0, 0, 4, 0, 1, 3, 4]


def test_word_vocabulary_comes_from_the_training_split_only() -> None:
    # 10 tokens, 0.3 holds out 3: "zebra zebra <eos>" never enters the vocabulary
    ids, vocab = encode("a b a b a b\nzebra zebra\n", "word", 100, 0.3)
    assert vocab.tokens == ("<unk>", "a", "b", "<eos>")
    assert ids.tolist() == [1, 2, 1, 2, 1, 2, 3, 0, 0, 3]


def test_literal_unk_in_the_text_is_the_unknown_id() -> None:
    ids, vocab = encode("the <unk> the\n", "word", 100, 0.1)
    assert vocab.tokens == ("<unk>", "the", "<eos>")
    assert ids.tolist() == [1, 0, 1, 2]


def test_char_vocabulary_most_frequent_first_ties_by_code_point() -> None:
    # "baab ca\n": 0.25 holds out "a\n"; train counts a 2, b 2, ' ' 1, c 1
    ids, vocab = encode("baab ca\n", "char", 100, 0.25)
    assert vocab.tokens == ("<unk>", "a", "b", " ", "c")
    assert ids.tolist() == [2, 1, 1, 2, 3, 4, 1, 0]  # "\n" only in the eval split: <unk>
    ids, vocab = encode("baab ca\n", "char", 3, 0.25)
    assert vocab.tokens == ("<unk>", "a", "b") and vocab.folded == 2
    assert ids.tolist() == [2, 1, 1, 2, 0, 0, 1, 0]


def test_byte_ids_are_utf8_bytes() -> None:
    ids, vocab = encode("aé\n", "byte", 256, 0.1)
    assert ids.tolist() == [97, 195, 169, 10]
    assert vocab.size == 256 and vocab.tokens == ()


def test_same_corpus_same_ids(tmp_path: Path) -> None:
    a = encode(DEFAULT_CORPUS.read_text(), "word", 300, 0.1)
    b = encode(DEFAULT_CORPUS.read_text(), "word", 300, 0.1)
    assert a[1] == b[1] and (a[0] == b[0]).all()
    assert int(a[0].max()) < 300


def test_split_point_is_floor_of_the_fraction() -> None:
    assert split_point(100, 0.29) == 71  # 100 * 0.29 is 28.999999999999996 in floating point
    assert split_point(18, 0.1) == 17
    assert split_point(9, 0.1) == 9


def test_vocab_file_round_trip_and_reuse(tmp_path: Path) -> None:
    vocab_file = tmp_path / "ckpt" / "vocab.json"
    first = TextBatches(
        None, example=lm_example(), vocab_size=40, global_rows=4, tokenizer="char", vocab_file=vocab_file
    )
    doc = json.loads(vocab_file.read_text())
    assert doc["tokenizer"] == "char" and doc["size"] == 40 and doc["tokens"][:3] == ["<unk>", " ", "e"]
    assert doc["folded"] == first.vocab.folded == 22
    assert [p.name for p in vocab_file.parent.iterdir()] == ["vocab.json"]  # no temporary file left
    assert Vocab.load(vocab_file) == first.vocab
    # another corpus read with the saved vocabulary keeps its ids (e is still 2, unseen z is <unk>)
    other = tmp_path / "other.txt"
    other.write_text("eez " * 40)
    again = TextBatches(
        other, example=lm_example(), vocab_size=40, global_rows=4, tokenizer="char", vocab_file=vocab_file
    )
    assert again.vocab == first.vocab
    assert ids_of(next(iter(again)))[0][0] == [2, 2]
    assert "read from" in again.describe()


def test_vocab_file_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    vocab_file = tmp_path / "vocab.json"
    TextBatches(None, example=lm_example(), vocab_size=300, global_rows=4, tokenizer="word", vocab_file=vocab_file)
    with pytest.raises(DataError, match="vocabulary file is for --tokenizer word, not char"):
        TextBatches(None, example=lm_example(), vocab_size=300, global_rows=4, tokenizer="char", vocab_file=vocab_file)
    with pytest.raises(DataError, match="has 300 ids but the model's vocabulary is 100"):
        TextBatches(None, example=lm_example(), vocab_size=100, global_rows=4, tokenizer="word", vocab_file=vocab_file)
    vocab_file.write_text("{not json")
    with pytest.raises(DataError, match="cannot read it as JSON"):
        TextBatches(None, example=lm_example(), vocab_size=300, global_rows=4, tokenizer="word", vocab_file=vocab_file)


# --- reading ------------------------------------------------------------------------------------


def test_default_corpus_is_the_shipped_shakespeare() -> None:
    assert DEFAULT_CORPUS == ROOT / "models" / "data" / "shakespeare.txt"
    corpus = read_corpus(None)
    assert corpus.files == (DEFAULT_CORPUS,) and corpus.text.startswith("SONNET I:\n")


def test_folder_reads_txt_files_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first")  # no final newline: one is added
    (tmp_path / "c.md").write_text("ignored")
    corpus = read_corpus(tmp_path)
    assert [f.name for f in corpus.files] == ["a.txt", "b.txt"]
    assert corpus.text == "first\nsecond\n"
    (tmp_path / "c.txt").write_text("third")
    assert read_corpus(tmp_path).text == "first\nsecond\nthird"  # the last file is kept as it is


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("e.txt", b"", "e.txt: the file is empty"),
        ("sub", "folder", "sub: the folder holds no .txt files"),
        ("l1.txt", b"abc\xff\xfedef", "l1.txt: not UTF-8 text: byte 0xff at byte offset 3"),
        ("nope.txt", "missing", "nope.txt: no such file or folder"),
    ],
)
def test_reading_errors_name_the_file(tmp_path: Path, name: str, content: bytes | str, message: str) -> None:
    path = tmp_path / name
    if content == "folder":
        path.mkdir()
        (path / "notes.md").write_text("not a .txt file")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        TextBatches(path, example=lm_example(), vocab_size=256, global_rows=1)
    assert "\n" not in str(info.value) and isinstance(info.value, PlannerError)


# --- batch layout, sharding, epochs ------------------------------------------------------------


def test_batchify_cuts_equal_contiguous_rows() -> None:
    assert batchify(torch.arange(11), 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_the_worked_example_of_docs_data_md() -> None:
    windows = StepWindows(batchify(torch.arange(24), 4), 2)
    assert len(windows) == 2  # floor((6 - 1) / 2)
    assert [[t.tolist() for t in windows[i]] for i in range(2)] == [
        [[[0, 1], [6, 7], [12, 13], [18, 19]], [[1, 2], [7, 8], [13, 14], [19, 20]]],
        [[[2, 3], [8, 9], [14, 15], [20, 21]], [[3, 4], [9, 10], [15, 16], [21, 22]]],
    ]
    with pytest.raises(IndexError):
        windows[2]


def test_windows_are_consecutive_bptt_windows(counting: Path) -> None:
    tb = counting_batches(counting)
    assert (tb.seq_len, tb.train_tokens, tb.eval_tokens, tb.steps_per_epoch, tb.eval_steps) == (2, 48, 12, 5, 1)
    stream = iter(tb)
    for step in range(5):
        inputs, target = ids_of(next(stream))
        # row r is ids 48 + 12 r .. ; step i reads [2i, 2i + 2) of every row, targets one further
        assert inputs == [[48 + 12 * r + 2 * step, 49 + 12 * r + 2 * step] for r in range(4)]
        assert target == [[49 + 12 * r + 2 * step, 50 + 12 * r + 2 * step] for r in range(4)]
    assert ids_of(next(stream))[0] == [[48, 49], [60, 61], [72, 73], [84, 85]]  # epoch 2 restarts at token 0


def test_replicas_shard_rows_and_together_see_the_global_batch(counting: Path) -> None:
    whole = draw(iter(counting_batches(counting)), 7)
    shards = [iter(counting_batches(counting, replica=k, replicas=2)) for k in range(2)]
    for step in range(7):
        parts = [next(s) for s in shards]
        assert torch.equal(torch.cat([p[0][0] for p in parts]), whole[step][0][0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[step][1])
    first = counting_batches(counting, replica=1, replicas=2)
    assert ids_of(next(iter(first)))[0] == [[72, 73], [84, 85]]
    assert first.describe() == (
        f"data {counting}: byte tokens, 256 byte ids; 48 train / 12 eval tokens; 5 steps per epoch of 4 rows x 2 "
        "tokens (rows 2-3 here), 1 eval batch"
    )
    with pytest.raises(DataError, match="global batch 4 does not split over 3 data-parallel replicas"):
        counting_batches(counting, replicas=3)


def test_eval_batches_are_the_held_out_windows(counting: Path) -> None:
    tb = counting_batches(counting)
    batches = [ids_of(b) for b in tb.eval_batches()]
    # eval ids 96..107 in 4 rows of 3: one window of 2
    assert batches == [([[96, 97], [99, 100], [102, 103], [105, 106]], [[97, 98], [100, 101], [103, 104], [106, 107]])]
    assert list(tb.eval_batches(max_batches=0)) == []
    shard = counting_batches(counting, replica=1, replicas=2)
    assert [ids_of(b)[0] for b in shard.eval_batches()] == [[[102, 103], [105, 106]]]


def test_eval_batches_of_the_default_corpus_in_a_fixed_order() -> None:
    tb = TextBatches(None, example=lm_example(seq_len=8), vocab_size=128, global_rows=4, tokenizer="char")
    first = [b[0][0] for b in tb.eval_batches(3)]
    again = [b[0][0] for b in tb.eval_batches(3)]
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, again))


# --- resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 4, 5, 6, 12])  # 5 steps per epoch: 5 and 6 sit at and past the boundary
def test_resume_draws_the_same_next_batches(counting: Path, k: int) -> None:
    tb = counting_batches(counting)
    stream = iter(tb)
    draw(stream, k)
    state = tb.state_dict()
    assert state["epoch"] == ((k - 1) // 5 if k else 0)  # an epoch ends when the next one's first batch is drawn
    expected = draw(stream, 7)
    fresh = counting_batches(counting)
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))  # a checkpoint round trip
    assert same(draw(iter(fresh), 7), expected)


def test_resume_on_a_real_model_format_and_another_replica_count() -> None:
    mf = load_model_file(ROOT / "models" / "hf" / "llama.py", "tiny")
    example = mf.module.make_batch(2, **mf.config)  # the raw keyword batch: input_ids, attention_mask
    args: dict[str, Any] = dict(example=example, vocab_size=512, global_rows=4, tokenizer="word")
    tb = TextBatches(None, **args)
    stream = iter(tb)
    draw(stream, tb.steps_per_epoch + 3)
    state = json.loads(json.dumps(tb.state_dict()))  # plain values: JSON keeps the state too
    expected = draw(stream, 4)
    # replica 1 of 2 resumes from the same state with the same step's rows 2..3
    half = TextBatches(None, **args, replica=1, replicas=2)
    half.load_state_dict(state)
    got = draw(iter(half), 4)
    for full, part in zip(expected, got):
        assert isinstance(part[0], dict) and list(part[0]) == ["input_ids", "attention_mask"]
        assert torch.equal(part[0]["input_ids"], full[0]["input_ids"][2:])
        assert torch.equal(part[1], full[1][2:])


def test_a_second_iterator_continues_the_stream(counting: Path) -> None:
    tb = counting_batches(counting)
    first = draw(iter(tb), 3)
    second = draw(iter(tb), 3)
    reference = draw(iter(counting_batches(counting)), 6)
    assert same(first + second, reference)


def test_state_of_another_stream_is_refused(counting: Path, tmp_path: Path) -> None:
    state = counting_batches(counting).state_dict()
    other = tmp_path / "other.txt"
    other.write_text(counting.read_text()[::-1])
    with pytest.raises(DataError, match=r"data stream is not this one: the text's training tokens \(--data, --tok"):
        counting_batches(other).load_state_dict(state)
    with pytest.raises(DataError, match="data stream is not this one: the global batch changed since it was saved"):
        counting_batches(counting, global_rows=2).load_state_dict(state)
    with pytest.raises(DataError, match="not a planner-text-batches version 1 state"):
        counting_batches(counting).load_state_dict({"epoch": 0})


# --- the model's batch format -------------------------------------------------------------------


def model_file(name: str) -> ModelFile:
    return load_model_file(ROOT / "models" / f"{name}.py", "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("name", LMS)
def test_every_language_model_trains_on_text(name: str) -> None:
    mf = model_file(name)
    model = mf.build(seed=0)
    example = mf.batch(2)
    with torch.no_grad():
        vocab_size = model_output(model(*example[0])).shape[-1]  # V as the runner takes it
    tb = TextBatches(None, example=example, vocab_size=vocab_size, global_rows=4, replica=1, replicas=2)
    inputs, target = next(iter(tb))
    assert type(inputs) is type(example[0]) and len(inputs) == len(example[0])
    for got, want in zip(inputs, example[0]):
        assert got.dtype == want.dtype and got.shape == (2, tb.seq_len)
    assert target.dtype == example[1].dtype and target.shape == (2, tb.seq_len)
    assert int(inputs[0].max()) < vocab_size and tb.vocab_size <= vocab_size
    assert torch.equal(inputs[0][:, 1:], target[:, :-1])  # the target is the next token
    with torch.no_grad():
        loss = mf.loss_fn(model(*inputs), target)
    assert torch.isfinite(loss)


def test_hf_llama_padding_mask_becomes_ones() -> None:
    mf = model_file("hf/llama")
    example = mf.batch(2)  # positional (input_ids, attention_mask), the mask with padding zeros
    assert int(example[0][1].min()) == 0
    inputs, _ = next(iter(TextBatches(None, example=example, vocab_size=512, global_rows=2)))
    assert torch.equal(inputs[1], torch.ones(2, 32, dtype=example[0][1].dtype))


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("toy", r"the model takes input 0: float32 \(2, 10\): no integer \(batch, seq_len\) tensor of token ids"),
        ("resnet50", r"input 0: float32 \(2, 3, 32, 32\): no integer"),
        ("hf/bert_mlm", "as a masked language model's are"),
    ],
)
def test_models_that_are_not_causal_token_lms_are_refused(name: str, words: str) -> None:
    with pytest.raises(DataError, match=words) as info:
        TextBatches(None, example=model_file(name).batch(2), vocab_size=512, global_rows=2)
    message = str(info.value)
    assert "--data reads text for token-id language models" in message
    assert "without --data, planner run trains on the model file's own" in message and "\n" not in message


def test_format_of_keyword_inputs_flat_target_and_constants() -> None:
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    example = (
        {"input_ids": ids, "attention_mask": torch.ones(2, 3, dtype=torch.bool), "token_type_ids": torch.zeros(2, 3)},
        torch.zeros(6, dtype=torch.long),
    )
    with pytest.raises(DataError, match="token_type_ids is neither the token ids nor a mask"):
        token_batch_format(example)  # a float segment tensor
    example[0]["token_type_ids"] = torch.zeros(2, 3, dtype=torch.int32)
    fmt = token_batch_format(example)
    assert (fmt.seq_len, fmt.roles, fmt.flat_target) == (3, ("ids", "ones", "zeros"), True)
    inputs, target = fmt.batch(torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([[2, 3, 4]]))
    assert inputs["input_ids"].tolist() == [[1, 2, 3]] and inputs["input_ids"].dtype == torch.long
    assert inputs["attention_mask"].tolist() == [[True, True, True]]
    assert inputs["token_type_ids"].dtype == torch.int32 and inputs["token_type_ids"].tolist() == [[0, 0, 0]]
    assert target.tolist() == [2, 3, 4]
    fmt = token_batch_format(([ids, None], ids))  # a list with a skipped parameter's None
    inputs, _ = fmt.batch(ids, ids)
    assert isinstance(inputs, list) and inputs[1] is None


@pytest.mark.parametrize(
    ("example", "words"),
    [
        (((torch.zeros(2, 3, dtype=torch.long), torch.arange(6).view(2, 3)), torch.zeros(2, 3, dtype=torch.long)),
         "several token-id tensors"),
        (((torch.zeros(2, 3, dtype=torch.long),), torch.zeros(2, dtype=torch.long)), r"target is int64 \(2,\)"),
        (((torch.zeros(2, 3, dtype=torch.long),), torch.zeros(2, 3)), r"target is float32 \(2, 3\)"),
        (((torch.zeros(2, 3, dtype=torch.long),), torch.full((2, 3), -100)), "ignored \\(-100\\) at 6 of 6 positions"),
        ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)), "not a tuple or dict"),
    ],
)  # fmt: skip
def test_format_refusals(example: Any, words: str) -> None:
    with pytest.raises(DataError, match=words):
        token_batch_format(example)


# --- options and lengths ------------------------------------------------------------------------


def test_corpus_too_short_says_how_many_tokens_are_needed(counting: Path) -> None:
    with pytest.raises(DataError, match="the eval split .* has 12 byte tokens but one batch of 8 rows x .* needs 24"):
        counting_batches(counting, global_rows=8)
    with pytest.raises(DataError, match="the training split has 48 byte tokens but one batch of 8 rows .* needs 56"):
        counting_batches(counting, global_rows=8, example=lm_example(seq_len=6), eval_fraction=0.2)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(tokenizer="bpe"), "--tokenizer 'bpe': not a tokenizer; expected one of char, byte, word"),
        (dict(vocab_size=200), "--tokenizer byte needs a model vocabulary of at least 256 .* the model's is 200"),
        (dict(eval_fraction=1.0), "eval fraction 1.0: expected a number between 0 and 1"),
        (dict(replica=2, replicas=2), "replica 2: expected 0..1"),
        (dict(global_rows=0), "global_rows 0: expected an integer of at least 1"),
    ],
)
def test_option_errors(counting: Path, kw: dict[str, Any], words: str) -> None:
    with pytest.raises(DataError, match=words):
        counting_batches(counting, **kw)


def test_describe_names_corpus_vocab_and_folded_types() -> None:
    tb = TextBatches(None, example=lm_example(seq_len=16), vocab_size=512, global_rows=8, tokenizer="word")
    assert tb.vocab_size == 512 and tb.vocab.folded == 1522
    assert tb.describe() == (
        f"data {DEFAULT_CORPUS}: word tokens, vocabulary 512 (1522 rarer types folded into <unk>); 9459 train / "
        "1050 eval tokens; 73 steps per epoch of 8 rows x 16 tokens (rows 0-7 here), 8 eval batches"
    )

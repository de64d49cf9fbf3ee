"""Tests for the model files in ``models/`` (loaded by path, as the planner does)."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.fx

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
MODEL_NAMES = ["gpt", "encoder_lm", "resnet50", "shakespeare", "toy", "llama"]


def load_model_file(name):
    """Load ``models/<name>.py`` by path (no package import, no sys.modules entry)."""
    path = MODELS_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_test_model_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", params=MODEL_NAMES)
def mf(request):
    return load_model_file(request.param)


def _loss(mf, out, target):
    if hasattr(mf, "loss_fn"):
        return mf.loss_fn(out, target)
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _count(module):
    return sum(p.numel() for p in module.parameters())


def test_contract(mf):
    assert callable(mf.build_model)
    assert callable(mf.make_batch)
    assert callable(mf.train_batches)
    assert callable(mf.loss_fn)
    assert mf.__doc__ and len(mf.__doc__) > 200
    assert "tiny" in mf.SIZES and len(mf.SIZES) >= 2
    for name, cfg in mf.SIZES.items():
        for k, v in cfg.items():
            assert isinstance(k, str)
            assert isinstance(v, (int, float, str, bool)), (name, k, v)
        # every function accepts (and ignores) extra keys
        with torch.device("meta"):
            mf.build_model(**cfg, unrelated_key=1)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_size_builds_on_meta(name):
    mf = load_model_file(name)
    for size, cfg in mf.SIZES.items():
        with torch.device("meta"):
            model = mf.build_model(**cfg)
        n = _count(model)
        print(f"{name}/{size}: {n:,} params")
        assert n > 0


@pytest.mark.slow
def test_tiny_forward_backward_and_trace(mf):
    cfg = mf.SIZES["tiny"]
    torch.manual_seed(0)
    model = mf.build_model(**cfg)
    torch.manual_seed(1)
    inputs, target = mf.make_batch(4, **cfg)
    assert isinstance(inputs, tuple)
    # make_batch is deterministic w.r.t. the global RNG
    torch.manual_seed(1)
    inputs2, target2 = mf.make_batch(4, **cfg)
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs2))
    assert torch.equal(target, target2)

    out = model(*inputs)
    loss = _loss(mf, out, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    gm = torch.fx.symbolic_trace(model)
    model.zero_grad()
    with torch.no_grad():
        assert torch.equal(gm(*inputs), model(*inputs))
    # same module FQNs available to the planner
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in model.named_parameters()}


@pytest.mark.slow
def test_loss_is_batch_mean(mf):
    """Microbatch losses average to the full-batch loss (dropout is 0 in tiny)."""
    cfg = mf.SIZES["tiny"]
    if mf.__name__.endswith("resnet50"):
        cfg = dict(cfg, norm="group")  # BatchNorm couples samples in train mode
    torch.manual_seed(0)
    model = mf.build_model(**cfg)
    torch.manual_seed(2)
    (x,), y = mf.make_batch(8, **cfg)
    full = _loss(mf, model(x), y)
    parts = [_loss(mf, model(xc), yc) for xc, yc in zip(x.chunk(4), y.chunk(4))]
    torch.testing.assert_close(full, torch.stack(parts).mean(), rtol=1e-5, atol=1e-5)


def test_train_batches_deterministic(mf):
    cfg = mf.SIZES["tiny"]
    a = mf.train_batches(4, **cfg)
    b = mf.train_batches(4, **cfg)
    for _ in range(3):
        (xa,), ya = next(a)
        (xb,), yb = next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # and the stream is not constant
    (x1,), _ = next(mf.train_batches(4, **cfg))
    it = mf.train_batches(4, **cfg)
    next(it)
    (x2,), _ = next(it)
    assert not torch.equal(x1, x2)


def test_train_batches_shapes_match_make_batch(mf):
    cfg = mf.SIZES["tiny"]
    (x,), y = next(mf.train_batches(4, **cfg))
    (xm,), ym = mf.make_batch(4, **cfg)
    assert x.shape == xm.shape and x.dtype == xm.dtype
    assert y.shape == ym.shape and y.dtype == ym.dtype


@pytest.mark.slow
def test_tiny_training_lowers_loss(mf):
    cfg = mf.SIZES["tiny"]
    torch.manual_seed(0)
    model = mf.build_model(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    it = mf.train_batches(8, **cfg)
    batches = [next(it) for _ in range(30)]
    eval_batch = batches[0]

    def eval_loss():
        with torch.no_grad():
            (x,), y = eval_batch
            return _loss(mf, model(x), y).item()

    model.eval()
    initial = eval_loss()
    model.train()
    for (x,), y in batches:
        opt.zero_grad()
        _loss(mf, model(x), y).backward()
        opt.step()
    model.eval()
    final = eval_loss()
    print(f"{mf.__name__}: loss {initial:.4f} -> {final:.4f}")
    assert math.isfinite(final) and final < 0.9 * initial


def test_encoder_lm_tutorial_is_1_4b():
    mf = load_model_file("encoder_lm")
    for size in ("tutorial", "paper"):
        with torch.device("meta"):
            model = mf.build_model(**mf.SIZES[size])
        n = _count(model)
        print(f"encoder_lm/{size}: {n:,} params")
        assert 1.3e9 < n < 1.5e9
        assert n == 1_444_261_998
    assert isinstance(model, torch.nn.Sequential)
    assert len(model) == mf.SIZES["tutorial"]["nlayers"] + 2


def test_resnet50_imagenet_matches_torchvision_count():
    mf = load_model_file("resnet50")
    with torch.device("meta"):
        model = mf.build_model(**mf.SIZES["imagenet"])
    assert _count(model) == 25_557_032
    with torch.device("meta"):
        gn = mf.build_model(**mf.SIZES["imagenet"], norm="group")
    assert _count(gn) == 25_557_032


def test_known_param_counts():
    expected = {
        ("gpt", "tutorial"): 43_883_280,
        ("shakespeare", "tutorial"): 10_788_929,  # Karpathy's "10.788929 M"
        ("toy", "tiny"): 165,
        ("toy", "wide"): 8_393_728,
    }
    for (name, size), n in expected.items():
        mf = load_model_file(name)
        with torch.device("meta"):
            assert _count(mf.build_model(**mf.SIZES[size])) == n, (name, size)


def test_gpt_structure():
    mf = load_model_file("gpt")
    model = mf.build_model(**mf.SIZES["tiny"])
    assert isinstance(model.layers, torch.nn.ModuleDict)
    assert len(model.layers) == mf.SIZES["tiny"]["n_layers"]
    assert all(isinstance(layer, torch.nn.TransformerDecoderLayer) for layer in model.layers.values())


@pytest.mark.parametrize("name", ["encoder_lm", "shakespeare"])
def test_missing_data_path_raises(name, tmp_path):
    mf = load_model_file(name)
    missing = tmp_path / "no_such_file.txt"
    with pytest.raises(FileNotFoundError, match="no_such_file.txt"):
        next(iter(mf.train_batches(4, **mf.SIZES["tiny"], data_path=str(missing))))


def test_custom_data_path(tmp_path):
    text = "To be, or not to be: that is the question.\n" * 200
    p = tmp_path / "t.txt"
    p.write_text(text)
    for name in ("encoder_lm", "shakespeare"):
        mf = load_model_file(name)
        (x,), y = next(mf.train_batches(2, **mf.SIZES["tiny"], data_path=str(p)))
        assert x.shape == y.shape


def test_basic_english_tokenizer():
    mf = load_model_file("encoder_lm")
    assert mf.basic_english('Hello, World! (It\'s) "fine"; ok: yes? a.b<br />c') == [
        "hello",
        ",",
        "world",
        "!",
        "(",
        "it",
        "'",
        "s",
        ")",
        "fine",
        "ok",
        "yes",
        "?",
        "a",
        ".",
        "b",
        "c",
    ]
    vocab = mf.build_vocab(["b", "a", "b", "c", "b", "a"], 3)
    assert vocab == {"<unk>": 0, "b": 1, "a": 2}


def test_encoder_lm_ids_in_range():
    mf = load_model_file("encoder_lm")
    cfg = mf.SIZES["tiny"]
    ids = mf.load_token_ids(None, cfg["ntokens"])
    assert ids.min() >= 0 and ids.max() < cfg["ntokens"]
    it = mf.train_batches(4, **cfg)
    (x,), y = next(it)
    # targets are the inputs shifted by one
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_shakespeare_data_and_vocab():
    mf = load_model_file("shakespeare")
    assert len(mf.CHARS) == 65 == mf.SIZES["tiny"]["vocab_size"]
    data_file = MODELS_DIR / "data" / "shakespeare.txt"
    text = data_file.read_text()
    assert 30_000 <= len(text.encode()) <= 60_000
    assert set(text) <= set(mf.CHARS)
    assert mf.decode(mf.encode("Shall I compare thee")) == "Shall I compare thee"
    assert mf.encode("\u00e9") == [mf.STOI[" "]]
    (x,), y = next(mf.train_batches(4, **mf.SIZES["tiny"]))
    assert torch.equal(x[:, 1:], y[:, :-1])

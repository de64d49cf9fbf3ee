"""Tier 2 (CPU torch): loading model files, --size/--set resolution and the errors users see."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.capture.load import ModelFile, default_loss, load_model_file, parse_overrides
from planner.errors import ModelFileError, PlannerError

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["gpt", "encoder_lm", "resnet50", "shakespeare", "toy"]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


GOOD = """
import torch
from torch import nn

SIZES = {"tiny": dict(d=4, n=2), "big": dict(d=64, n=8)}

def build_model(d=8, n=3, **_):
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])

def make_batch(batch_size, d=8, extra_flag=False, **_):
    return (torch.randn(batch_size, d),), torch.randn(batch_size, d)
"""


# --- the shipped model files ------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_every_model_file_loads_builds_and_batches(name):
    mf = load_model_file(ROOT / "models" / f"{name}.py", "tiny")
    assert isinstance(mf, ModelFile)
    assert mf.path == (ROOT / "models" / f"{name}.py").resolve()
    assert mf.size == "tiny"
    assert mf.config == mf.module.SIZES["tiny"]
    assert mf.config is not mf.module.SIZES["tiny"]  # a copy: overrides never edit the file's SIZES
    model = mf.build(seed=0)
    assert isinstance(model, nn.Module)
    inputs, target = mf.batch(2, seed=0)
    assert isinstance(inputs, tuple) and isinstance(target, torch.Tensor)
    loss = mf.loss_fn(model(*inputs), target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert len(mf.digest) == 16 and int(mf.digest, 16) >= 0


def test_build_and_batch_are_seeded():
    mf = load_model_file(ROOT / "models" / "toy.py", "tiny")
    a, b = mf.build(seed=3), mf.build(seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert not torch.equal(mf.build(seed=4).net1.weight, a.net1.weight)
    (x1,), y1 = mf.batch(4, seed=7)
    (x2,), y2 = mf.batch(4, seed=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_no_size_uses_file_defaults(tmp_path):
    mf = load_model_file(write(tmp_path, "m.py", GOOD))
    assert mf.size is None and mf.config == {}
    assert len(mf.build()) == 3  # build_model's own default n=3


def test_default_loss_is_cross_entropy_over_last_dim():
    out = torch.tensor([[[2.0, 0.0], [0.0, 2.0]]])
    target = torch.tensor([[0, 1]])
    expected = torch.nn.functional.cross_entropy(out.reshape(-1, 2), target.reshape(-1))
    assert torch.equal(default_loss(out, target), expected)
    mf = load_model_file(ROOT / "models" / "toy.py")
    y, t = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.equal(mf.loss_fn(y, t), torch.nn.functional.mse_loss(y, t))  # the file's own loss_fn wins


def test_file_without_loss_fn_gets_default(tmp_path):
    mf = load_model_file(write(tmp_path, "m.py", GOOD))
    out, target = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    assert torch.equal(mf.loss_fn(out, target), default_loss(out, target))


def test_a_dict_like_result_reaches_loss_fn_as_its_logits(tmp_path):
    from collections import OrderedDict

    mf = load_model_file(write(tmp_path, "m.py", GOOD))
    logits, target = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    want = default_loss(logits, target)
    # a Hugging Face ModelOutput is an OrderedDict: logits by name, else the first entry
    assert torch.equal(mf.loss_fn(OrderedDict(loss=None, logits=logits), target), want)
    assert torch.equal(mf.loss_fn({"last_hidden_state": logits}, target), want)


# --- sizes and --set --------------------------------------------------------------------------


def test_unknown_size_lists_known_sizes():
    with pytest.raises(ModelFileError) as e:
        load_model_file(ROOT / "models" / "gpt.py", "huge")
    msg = str(e.value)
    assert "'huge'" in msg and "gpt.py" in msg
    assert "known sizes: tiny, tutorial" in msg


def test_size_on_a_file_without_sizes(tmp_path):
    path = write(tmp_path, "nosizes.py", GOOD.replace('SIZES = {"tiny": dict(d=4, n=2), "big": dict(d=64, n=8)}', ""))
    with pytest.raises(ModelFileError, match="no SIZES"):
        load_model_file(path, "tiny")


def test_parse_overrides_json_and_strings():
    got = parse_overrides(
        [
            "n_layers=8",
            "dropout=0.1",
            "flag=true",
            "name=gpt",
            "shape=[1, 2]",
            "none=null",
            "empty=",
            "eq=a=b",
            " key =3",
        ]
    )
    assert got == {
        "n_layers": 8,
        "dropout": 0.1,
        "flag": True,
        "name": "gpt",
        "shape": [1, 2],
        "none": None,
        "empty": "",
        "eq": "a=b",
        "key": 3,
    }
    assert type(got["n_layers"]) is int and type(got["dropout"]) is float
    assert parse_overrides([]) == {}


@pytest.mark.parametrize("pair", ["n_layers", "=8", " =8", ""])
def test_parse_overrides_bad_pair(pair):
    with pytest.raises(ModelFileError) as e:
        parse_overrides([pair])
    assert repr(pair) in str(e.value) and "key=value" in str(e.value)


def test_overrides_replace_and_add_config_entries(tmp_path):
    mf = load_model_file(write(tmp_path, "m.py", GOOD), "tiny", {"n": 5, "extra_flag": True})
    assert mf.config == {"d": 4, "n": 5, "extra_flag": True}
    assert mf.module.SIZES["tiny"] == {"d": 4, "n": 2}
    assert len(mf.build()) == 5


def test_override_on_real_model_changes_the_model():
    mf = load_model_file(ROOT / "models" / "gpt.py", "tiny", parse_overrides(["n_layers=2"]))
    assert mf.config["n_layers"] == 2
    assert len(mf.build().layers) == 2


def test_unknown_override_key_names_known_keys(tmp_path):
    with pytest.raises(ModelFileError) as e:
        load_model_file(write(tmp_path, "m.py", GOOD), "tiny", {"n_layerz": 3})
    msg = str(e.value)
    assert "--set n_layerz" in msg and "m.py" in msg
    # keys from SIZES and from the contract functions' signatures (not batch_size)
    assert "known keys: d, extra_flag, n" in msg


def test_unknown_override_key_on_shipped_model():
    with pytest.raises(ModelFileError) as e:
        load_model_file(ROOT / "models" / "gpt.py", "tiny", {"layers": 3})
    msg = str(e.value)
    assert "'layers'" in msg
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len"):
        assert key in msg


# --- broken files -----------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError) as e:
        load_model_file(tmp_path / "nope.py")
    assert "nope.py" in str(e.value) and "does not exist" in str(e.value)


def test_directory_is_not_a_model_file(tmp_path):
    with pytest.raises(ModelFileError, match="is a folder without config.json, so not a Hugging Face model folder"):
        load_model_file(tmp_path)
    (tmp_path / "a.py").write_text("")
    with pytest.raises(ModelFileError, match=r"is a folder, not a model file; give one of its Python files \(a.py\)"):
        load_model_file(tmp_path)
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model_file(tmp_path / "nope.py")


def test_file_raising_on_import_names_file_and_line(tmp_path):
    path = write(
        tmp_path,
        "broken.py",
        """
        import torch

        def helper():
            return 1

        raise RuntimeError("boom at import")
        """,
    )
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert "RuntimeError: boom at import" in msg
    assert "broken.py:6" in msg
    assert isinstance(e.value.__cause__, RuntimeError)  # raise ... from e


def test_syntax_error_on_import(tmp_path):
    path = write(tmp_path, "syntax.py", "def build_model(:\n    pass\n")
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    assert "SyntaxError" in str(e.value) and "syntax.py" in str(e.value)


def test_failed_import_leaves_no_module_behind(tmp_path):
    import sys

    before = set(sys.modules)
    with pytest.raises(ModelFileError):
        load_model_file(write(tmp_path, "broken.py", "raise ValueError('x')\n"))
    assert not [m for m in set(sys.modules) - before if m.startswith("planner_model_")]


def test_a_model_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """As `python model.py` would: its folder first on the path (a helper module beside it)."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # (the folder is kept on the path: not for later tests)
    write(tmp_path, "planner_test_helper_layers.py", "from torch import nn\n\nWIDTH = 3\n")
    path = write(
        tmp_path,
        "uses_helper.py",
        """
        import torch
        from planner_test_helper_layers import WIDTH, nn

        def build_model(**_):
            return nn.Linear(WIDTH, WIDTH)

        def make_batch(batch_size, **_):
            return (torch.randn(batch_size, WIDTH),), torch.randn(batch_size, WIDTH)
        """,
    )
    mf = load_model_file(path)
    assert mf.build(seed=0).in_features == 3
    sys.modules.pop("planner_test_helper_layers", None)


def test_file_missing_make_batch(tmp_path):
    path = write(tmp_path, "nobatch.py", "from torch import nn\n\ndef build_model(**_):\n    return nn.Linear(2, 2)\n")
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert "does not define make_batch;" in msg
    assert "make_batch(batch_size, **config)" in msg


def test_file_missing_both_functions(tmp_path):
    with pytest.raises(ModelFileError, match="does not define build_model and make_batch"):
        load_model_file(write(tmp_path, "empty.py", "x = 1\n"))


@pytest.mark.parametrize(
    "ret, kind",
    [
        ("torch.randn(batch_size, 4)", "Tensor"),
        ("(torch.randn(batch_size, 4), torch.randn(batch_size, 4))", "(Tensor, Tensor)"),  # inputs not a tuple
        ("((torch.randn(batch_size, 4),),)", "(tuple)"),  # no target
        ("[(torch.randn(batch_size, 4),), torch.randn(batch_size, 4)]", "list"),
    ],
)
def test_make_batch_returning_wrong_shape(tmp_path, ret, kind):
    path = write(
        tmp_path,
        "badbatch.py",
        f"""
        import torch
        from torch import nn

        def build_model(**_):
            return nn.Linear(4, 4)

        def make_batch(batch_size, **_):
            return {ret}
        """,
    )
    mf = load_model_file(path)
    with pytest.raises(ModelFileError) as e:
        mf.batch(2)
    msg = str(e.value)
    assert "badbatch.py" in msg and "make_batch()" in msg
    assert (
        "a pair (inputs, target_tensor), the inputs a tuple or a dict of keyword inputs" in msg and f"got {kind}" in msg
    )


def test_build_model_type_error_on_bad_config(tmp_path):
    path = write(
        tmp_path,
        "strict.py",
        """
        import torch
        from torch import nn

        SIZES = {"tiny": dict(d=4, depth=2)}

        def build_model(d=4):
            return nn.Linear(d, d)

        def make_batch(batch_size, d=4, depth=2):
            return (torch.randn(batch_size, d),), torch.randn(batch_size, d)
        """,
    )
    mf = load_model_file(path, "tiny")
    with pytest.raises(ModelFileError) as e:
        mf.build()
    msg = str(e.value)
    assert "strict.py" in msg and "build_model()" in msg and "depth" in msg
    assert "--size/--set" in msg
    assert isinstance(e.value.__cause__, TypeError)


def test_build_model_raising_names_the_line(tmp_path):
    path = write(
        tmp_path,
        "raises.py",
        """
        import torch

        def build_model(**_):
            raise RuntimeError("no weights here")

        def make_batch(batch_size, **_):
            return (torch.zeros(batch_size),), torch.zeros(batch_size)
        """,
    )
    with pytest.raises(ModelFileError) as e:
        load_model_file(path).build()
    assert "build_model() raised RuntimeError: no weights here (at raises.py:4)" in str(e.value)


def test_missing_data_file_is_a_model_file_error(tmp_path):
    # train_batches is usually a generator function: its errors appear on the first next(), not
    # when it is called, and must still come out as a ModelFileError.
    mf = load_model_file(ROOT / "models" / "encoder_lm.py", "tiny", {"data_path": str(tmp_path / "none.txt")})
    with pytest.raises(ModelFileError) as e:
        next(mf.train_batches(2))
    msg = str(e.value)
    assert "encoder_lm.py" in msg and "train_batches()" in msg and "none.txt" in msg


def test_make_batch_missing_file_is_a_model_file_error(tmp_path):
    path = write(
        tmp_path,
        "reads.py",
        """
        import torch
        from torch import nn

        def build_model(**_):
            return nn.Linear(2, 2)

        def make_batch(batch_size, path="/nonexistent/data.txt", **_):
            open(path).read()
        """,
    )
    with pytest.raises(ModelFileError) as e:
        load_model_file(path).batch(2)
    assert "reads.py: make_batch() could not open a file" in str(e.value) and "data.txt" in str(e.value)


def test_train_batches_checks_what_it_yields(tmp_path):
    path = write(tmp_path, "stream.py", GOOD + "\ndef train_batches(batch_size, **_):\n    yield 1\n")
    with pytest.raises(ModelFileError, match="train_batches"):
        next(load_model_file(path).train_batches(2))


def test_default_train_batches_are_fresh_make_batch_batches(tmp_path):
    mf = load_model_file(write(tmp_path, "m.py", GOOD), "tiny")
    stream = mf.train_batches(3, seed=5)
    first, second = next(stream), next(stream)
    assert torch.equal(first[0][0], mf.batch(3, seed=5)[0][0])
    assert torch.equal(second[0][0], mf.batch(3, seed=6)[0][0])


def test_model_file_errors_are_planner_errors():
    assert issubclass(ModelFileError, PlannerError) and issubclass(ModelFileError, ValueError)


def test_a_stream_that_ends_is_a_one_line_error(tmp_path: Path) -> None:
    from planner.capture.load import load_model_file
    from planner.errors import ModelFileError

    path = tmp_path / "short.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "def build_model(**c):\n    return nn.Linear(2, 2)\n"
        "def make_batch(b, **c):\n    return (torch.randn(b, 2),), torch.zeros(b, dtype=torch.long)\n"
        "def train_batches(b, **c):\n    for _ in range(2):\n        yield make_batch(b)\n"
    )
    stream = load_model_file(path).train_batches(4)
    next(stream), next(stream)
    with pytest.raises(ModelFileError, match="train_batches\\(\\) ended after 2 batch\\(es\\)"):
        next(stream)


ANY_KEY = """
import torch
from torch import nn

def build_model(width=8, **config):
    model = nn.Linear(width, 4)
    model.passed_on = dict(config)
    return model

def make_batch(batch_size, width=8, **_ignored):
    return (torch.randn(batch_size, width),), torch.randint(0, 4, (batch_size,))
"""


def test_set_takes_any_key_a_build_model_with_config_kwargs_passes_on(tmp_path: Path) -> None:
    """`--set use_cache=false` reaches a Hugging Face config through `build_model(**config)`; a file whose
    catch-all is `**_ignored` (the shipped ones) still refuses a key it would drop."""
    mf = load_model_file(write(tmp_path, "anykey.py", ANY_KEY), None, {"use_cache": False, "width": 16})
    assert mf.build().passed_on == {"use_cache": False}
    with pytest.raises(ModelFileError, match="toy.py has no config key 'depth'.*takes any"):
        load_model_file(ROOT / "models" / "toy.py", None, {"depth": 3})


def test_every_config_of_a_transformers_model_stops_caching() -> None:
    """An encoder-decoder's decoder keeps a config of its own (T5): its cache made the forward return
    a cache object torch.export cannot follow, while the top config said use_cache=False."""
    transformers = pytest.importorskip("transformers")
    from planner.capture.load import prepare_model

    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2
    )
    model = prepare_model(transformers.T5ForConditionalGeneration(config))
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    assert len({id(c) for c in configs}) > 1  # the decoder's is another object
    assert all(c.use_cache is False for c in configs)

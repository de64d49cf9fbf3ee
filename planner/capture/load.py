"""Loading a model file that follows the model-file contract (README.md, docs/architecture.md).

Required: ``build_model(**config) -> nn.Module`` and
``make_batch(batch_size, **config) -> (inputs, target)``, the inputs a tuple of positional
arguments or a dict of keyword arguments (``{"input_ids": ..., "attention_mask": ...}``, as Hugging
Face models are called).
Optional: ``loss_fn(output, target)``, ``train_batches(batch_size, **config)``, ``SIZES``.

Models as users bring them are taken as they are (``prepare_model``, ``model_output``): a Hugging
Face model trains without its KV cache, and a ``ModelOutput`` (or any dict) result reaches
``loss_fn`` as its ``logits``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import ModelFileError, listed
from planner.schema.outputs import document_kind
from planner.torch_compat import quiet_torchao_import

Batch = tuple[tuple, torch.Tensor]


def model_output(out: Any) -> Any:
    """What ``loss_fn`` receives for a model's result: a dict-like result (a Hugging Face
    ``ModelOutput`` is an ordered dict) gives its ``logits``, or its first entry when it has none;
    anything else is passed on as it is.

    Works on the values of a run and on the graph nodes of a trace alike, so the last pipeline
    stage returns exactly what the unsplit model's loss sees.

    Args:
        out: the model's forward result.

    Returns:
        The logits (or first entry) of a dict-like result, else ``out``.
    """
    if isinstance(out, Mapping) and out:
        return out["logits"] if "logits" in out else next(iter(out.values()))
    return out


def prepare_model(model: nn.Module) -> nn.Module:
    """Switch off what a model does for inference only, in place: a Hugging Face model's KV cache.

    A ``transformers`` model returns its key/value cache by default (``config.use_cache``); training
    never reads it, and the cache object is neither a tensor nor traceable by torch.export. Every
    config is switched off, not only the top one: an encoder-decoder's decoder stack keeps a config
    of its own (T5), and composite configs hold sub-configs (``text_config``, ``decoder``).

    Args:
        model: the model ``build_model`` returned.

    Returns:
        The same model.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None:
            continue
        try:
            inner = [v for v in vars(config).values() if hasattr(v, "use_cache")]
        except TypeError:  # a config without __dict__ holds no sub-configs
            inner = []
        for cfg in (config, *inner):
            if getattr(cfg, "use_cache", None) is True:
                cfg.use_cache = False
    return model


def forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    """The parameters of ``model.forward`` that can be given by position, in order."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C-implemented forward has no signature to read
        return []
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def bind_inputs(inputs: Mapping[str, Any], params: list[inspect.Parameter], what: str) -> tuple:
    """Keyword inputs as ``forward``'s positional arguments, bound by name; parameters skipped before
    the last one given get their defaults (None, mostly).

    Args:
        inputs: the inputs by name.
        params: ``forward``'s positional parameters (``forward_parameters``).
        what: what gave the inputs, for the messages (``"model.py: make_batch()"``).

    Returns:
        The positional arguments, up to the last one given.

    Raises:
        ModelFileError: a name ``forward`` has no positional parameter for, or a skipped
            parameter without a default.
    """
    names = [p.name for p in params]
    unknown = [k for k in inputs if k not in names]
    if unknown:
        raise ModelFileError(
            f"{what} gives keyword input(s) {', '.join(map(repr, unknown))} that the model's "
            f"forward() has no parameter of that name for (its parameters: {', '.join(names) or 'none'})"
        )
    last = max(names.index(k) for k in inputs)
    missing = [p.name for p in params[:last] if p.name not in inputs and p.default is inspect.Parameter.empty]
    if missing:
        raise ModelFileError(
            f"{what} gives {', '.join(inputs)} but not {', '.join(missing)}, which forward() needs before them; give it too"
        )
    return tuple(inputs[p.name] if p.name in inputs else p.default for p in params[: last + 1])


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (the contract's default ``loss_fn``)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def parse_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """Parse ``--set key=value`` pairs; values are JSON when they parse as JSON, else strings.

    Args:
        pairs: strings of the form ``key=value``.

    Returns:
        The overrides as a dict.

    Raises:
        ModelFileError: for a pair without ``=`` or with an empty key, or a JSON value too deeply
            nested or with too long an integer to read.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ModelFileError(f"--set {pair!r}: expected key=value, e.g. --set n_layers=8")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
        except RecursionError as e:  # json's decoder recurses once per [ or {
            raise ModelFileError(
                f"--set {_shown_key(key.strip())}: the value is nested too deeply to read; give a flatter value"
            ) from e
        except ValueError as e:  # int() refuses integers past sys.get_int_max_str_digits() (4300 by default)
            raise ModelFileError(
                f"--set {_shown_key(key.strip())}: the value has an integer of more than "
                f"{sys.get_int_max_str_digits()} digits; give a smaller number"
            ) from e
    return out


def _shown_key(key: object) -> str:
    """A --set key as messages show it: as typed, or quoted when a line break or another control
    character in it would break the one-line message."""
    text = str(key)
    return text if text.isprintable() else repr(text)


@dataclass
class ModelFile:
    """A loaded model file with its resolved configuration.

    Attributes:
        path: absolute path of the file.
        module: the imported Python module.
        size: the SIZES entry used, or None for the file's own defaults.
        config: the configuration passed to every contract function.
    """

    path: Path
    module: ModuleType
    size: str | None
    config: dict[str, Any] = field(default_factory=dict)
    # forward()'s positional parameters, read at the first build: keyword batches are bound to them
    _forward: list[inspect.Parameter] | None = field(default=None, repr=False)

    def build(self, seed: int = 0) -> nn.Module:
        """Build the model with the torch RNG seeded, so every process builds the same weights.

        Raises:
            ModelFileError: when ``build_model`` raises.
        """
        torch.manual_seed(seed)
        with quiet_torchao_import():  # a transformers model imports torchao where it is installed
            model = self._call("build_model", self.module.build_model, **self.config)
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{self.path.name}: build_model() returned {type(model).__name__}; expected a torch.nn.Module"
            )
        if self._forward is None:
            self._forward = forward_parameters(model)
        return prepare_model(model)

    def batch(self, batch_size: int, seed: int = 0) -> Batch:
        """One example batch from ``make_batch`` (seeded).

        Raises:
            ModelFileError: when ``make_batch`` raises or returns the wrong shape of thing.
        """
        torch.manual_seed(seed)
        out = self._call("make_batch", self.module.make_batch, batch_size, **self.config)
        return self._positional(_check_batch(out, "make_batch", self.path), "make_batch")

    def _positional(self, batch: tuple[Any, torch.Tensor], name: str) -> Batch:
        """A batch with keyword inputs turned into positional ones, bound to ``forward``'s parameters
        by name; parameters skipped before the last one given get their defaults (None, mostly).

        The planner calls the model, traces it and feeds its first stage positionally; binding here,
        once, keeps every one of those paths the same.

        Raises:
            ModelFileError: a name ``forward`` has no positional parameter for, or a skipped
                parameter without a default.
        """
        inputs, target = batch
        if isinstance(inputs, tuple):
            return inputs, target
        if self._forward is None:
            # only the signature is wanted: no weights are allocated, and build()'s reseeding must
            # not reach the caller's RNG (a train_batches stream drawing from it, say)
            with torch.device("meta"), torch.random.fork_rng(devices=[]):
                self.build()
        return bind_inputs(inputs, self._forward or [], f"{self.path.name}: {name}()"), target

    @property
    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The file's ``loss_fn`` (or the default cross-entropy), given ``model_output(output)``."""
        user = getattr(self.module, "loss_fn", None) or default_loss

        def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            return user(model_output(output), target)

        return loss

    def train_batches(self, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        """The file's training stream, or fresh ``make_batch`` batches from a seeded RNG.

        Raises:
            ModelFileError: when ``train_batches`` raises or yields the wrong shape of thing.
        """
        fn = getattr(self.module, "train_batches", None)
        if fn is None:
            return self._make_batch_stream(batch_size, seed)
        torch.manual_seed(seed)
        stream = self._call("train_batches", fn, batch_size, **self.config)
        return self._checked_stream(iter(stream))

    def _checked_stream(self, stream: Iterator[Any]) -> Iterator[Batch]:
        """Yield from a train_batches stream, turning its errors into one-line ModelFileErrors."""
        count = 0
        while True:
            try:
                batch = next(stream)
            except StopIteration:
                raise ModelFileError(
                    f"{self.path.name}: train_batches() ended after {count} batch(es); planner run takes one "
                    "batch per step: make the stream cycle over its data"
                ) from None
            except Exception as e:
                raise self._raised("train_batches", e) from e
            count += 1
            yield self._positional(_check_batch(batch, "train_batches", self.path), "train_batches")

    def _make_batch_stream(self, batch_size: int, seed: int) -> Iterator[Batch]:
        step = 0
        while True:
            yield self.batch(batch_size, seed=seed + step)
            step += 1

    def _call(self, name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError as e:
            raise ModelFileError(f"{self.path.name}: {name}() could not open a file: {e}") from e
        except TypeError as e:
            if name not in ("build_model", "make_batch", "train_batches"):
                raise self._raised(name, e) from e
            raise ModelFileError(
                f"{self.path.name}: {name}() rejected the config {self.config}: {e}; "
                "check --size/--set against the file's SIZES"
            ) from e
        except Exception as e:
            raise self._raised(name, e) from e

    def _raised(self, name: str, e: Exception) -> ModelFileError:
        """The one-line error for an exception the model file's ``name`` raised, with its line.

        Where the file defines no ``loss_fn``, the loss that raised is the contract's default, which
        the user never wrote: the line says so and how to give another.
        """
        if name == "loss_fn" and getattr(self.module, "loss_fn", None) is None:
            return ModelFileError(
                f"{self.path.name} defines no loss_fn, and the default (cross-entropy of the output's last "
                f"dimension against integer class targets) raised {type(e).__name__}: {str(e).rstrip('.')}; define "
                "loss_fn(output, target) returning a scalar, e.g. F.mse_loss(output, target)"
            )
        return ModelFileError(f"{self.path.name}: {name}() raised {type(e).__name__}: {e}{_user_frame(e, self.path)}")

    def part_digests(self) -> dict[str, str]:
        """A short hash of the source of each contract function the file defines, and of ``SIZES``.

        Stored in the plan, so that ``planner run`` can say *what* changed in a model file since
        planning (``loss_fn``, say), not only that the file changed.

        Returns:
            name -> SHA-256 prefix; functions whose source cannot be read are left out.
        """
        out: dict[str, str] = {}
        for name in ("build_model", "make_batch", "loss_fn", "train_batches", "SIZES"):
            value = getattr(self.module, name, None)
            if value is None:
                continue
            try:
                text = repr(value) if name == "SIZES" else inspect.getsource(value)
            except (OSError, TypeError):
                continue
            out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return out

    @property
    def digest(self) -> str:
        """SHA-256 (first 16 hex digits) of the file's text, to notice edits between plan and run."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]


def _user_frame(e: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path]
    return f" (at {path.name}:{frames[-1].lineno})" if frames else ""


def _check_batch(out: Any, name: str, path: Path) -> tuple[Any, torch.Tensor]:
    keyword = isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Mapping)
    if keyword and not all(isinstance(k, str) for k in out[0]):
        raise ModelFileError(f"{path.name}: {name}() returned a dict of inputs whose keys are not all names")
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and (isinstance(out[0], tuple) or keyword)
        and isinstance(out[1], torch.Tensor)
    ):
        whole = " (the whole batch as one dict: give the target apart)" if isinstance(out, Mapping) else ""
        raise ModelFileError(
            f"{path.name}: {name}() must return a pair (inputs, target_tensor), the inputs a tuple or a dict of "
            f"keyword inputs; got {shape_of(out)}{whole}; e.g. return (tokens,), targets"
        )
    return (dict(out[0]) if keyword else out[0]), out[1]


def shape_of(out: Any) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(type(x).__name__ for x in out) + ")"
    return type(out).__name__


_WANTED = "give the path of a .py file with build_model and make_batch, or of a Hugging Face model folder"
_LISTED = 5  # names listed from a folder before "... and N more"


def _not_a_model_file(path: str | Path, p: Path) -> ModelFileError:
    """Why ``p`` (``path`` as the user typed it), which is not a regular file, cannot be a model.

    A folder is the common mistake and each kind gets its own fix: a folder of Hugging Face model
    folders names the models in it, a folder of Python files names the files, a folder without
    config.json says that is what is missing. A FIFO or a device is named as such (reading one would
    block or never end), and only a path that is not there "does not exist".

    Args:
        path: the path as given.
        p: the path resolved.

    Returns:
        The error to raise.
    """
    if p.is_dir():
        try:
            entries = sorted(p.iterdir())
        except OSError as e:
            return ModelFileError(f"model folder {path} cannot be read ({e.strerror or e}); {_WANTED}")
        models = [e.name for e in entries if (e / "config.json").is_file()]
        if models:
            return ModelFileError(
                f"{path} is a folder of models ({listed(models, _LISTED)}), not one model; give one of them, "
                f"e.g. {Path(path) / models[0]}"
            )
        files = [e.name for e in entries if e.suffix == ".py" and e.is_file()]
        if files:
            return ModelFileError(
                f"{path} is a folder, not a model file; give one of its Python files ({listed(files, _LISTED)}), "
                f"e.g. {Path(path) / files[0]}"
            )
        return ModelFileError(f"{path} is a folder without config.json, so not a Hugging Face model folder; {_WANTED}")
    if p.exists():
        kind = (
            "a FIFO"
            if p.is_fifo()
            else "a socket"
            if p.is_socket()
            else "a device"
            if p.is_block_device() or p.is_char_device()
            else "not a regular file"
        )
        return ModelFileError(f"model file {path} is {kind}, not a file the planner can read; {_WANTED}")
    return ModelFileError(f"model file {path} does not exist; {_WANTED}")


def load_model_file(path: str | Path, size: str | None = None, overrides: dict[str, Any] | None = None) -> ModelFile:
    """Import a model file and resolve its configuration.

    Args:
        path: the model file (any Python file that follows the contract).
        size: a key of the file's ``SIZES``; None uses the file's own defaults.
        overrides: config entries to replace or add (``--set key=value``).

    Returns:
        The loaded ModelFile.

    Raises:
        ModelFileError: missing or unresolvable path, import failure (``sys.exit()`` included),
            missing contract functions, SIZES that is not a dict of config dicts, unknown size or
            unknown config key.
    """
    try:
        p = Path(path).expanduser().resolve()
    except (RuntimeError, ValueError, OSError) as e:  # an unknown ~user, a symlink loop, a NUL in the path
        raise ModelFileError(
            f"model file {path} cannot be found ({e}); give the path of a .py file with build_model and make_batch"
        ) from e
    if p.is_dir() and (p / "config.json").is_file():  # a Hugging Face model folder
        p = p / "config.json"
    if not p.is_file():
        raise _not_a_model_file(path, p)
    if p.suffix == ".json":
        return _hf_config_file(p, size, overrides)
    name = "planner_model_" + hashlib.sha256(str(p).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    # as `python model.py` does: the file's folder first on the path, so that it imports the modules
    # beside it (kept: its functions may import them when called)
    if str(p.parent) not in sys.path:
        sys.path.insert(0, str(p.parent))
    try:
        with quiet_torchao_import():  # a model file importing transformers imports torchao where it is installed
            spec.loader.exec_module(module)
    except SystemExit as e:  # a script's sys.exit() must not end the planner (KeyboardInterrupt still does)
        sys.modules.pop(name, None)
        raise ModelFileError(
            f"importing {path} failed: it called sys.exit({e.code!r}){_user_frame(e, p)}; a model file must not exit "
            'when imported: put script code under `if __name__ == "__main__":`'
        ) from e
    except Exception as e:
        sys.modules.pop(name, None)
        raise ModelFileError(f"importing {path} failed: {type(e).__name__}: {e}{_user_frame(e, p)}") from e
    missing = [f for f in ("build_model", "make_batch") if not callable(getattr(module, f, None))]
    if missing:
        raise ModelFileError(
            f"{path} does not define {' and '.join(missing)}; a model file needs "
            "build_model(**config) -> nn.Module and make_batch(batch_size, **config) -> (inputs, target)"
        )
    sizes = _sizes(module, p)
    if size is not None and size not in sizes:
        known = ", ".join(sizes) or "none (the file has no SIZES)"
        raise ModelFileError(f"size {size!r} is not in {p.name}'s SIZES; known sizes: {known}")
    config = dict(sizes[size]) if size is not None else {}
    for key, value in (overrides or {}).items():
        if key not in _known_keys(module, sizes) and not _takes_any_key(module):
            known = ", ".join(sorted(_known_keys(module, sizes))) or "none"
            raise ModelFileError(
                f"--set {_shown_key(key)}: {p.name} has no config key {key!r}; known keys: {known} "
                "(a build_model(..., **config) that passes other keys on takes any)"
            )
        config[key] = value
    return ModelFile(p, module, size, config)


def _hf_config_file(path: Path, size: str | None, overrides: dict[str, Any] | None) -> ModelFile:
    """A Hugging Face ``config.json`` served as a model file (``planner.capture.hf_config``).

    Raises:
        ModelFileError: ``--size`` given (a config has no sizes), a file that is no JSON object, or one
            transformers cannot read or a ``--set`` key its config does not know (``hf_config.check_config``).
    """
    if size is not None:
        raise ModelFileError(
            f"{path.name} is a Hugging Face config, which has no sizes; change it with --set (seq_len=N, or a "
            "config field such as num_hidden_layers=2)"
        )
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ModelFileError(f"{path} cannot be read as JSON ({e}); give a model's config.json") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path} holds no JSON object; give a model's config.json")
    kind = document_kind(data)
    if kind is not None:  # `planner plan plan.json`: one of the planner's own files, not a model
        use = {
            "plan": f"train with it (planner run {path}) or re-plan the model file it names",
            "run result": f"calibrate a plan with it (planner plan MODEL --calibrate {path})",
            "calibration": f"calibrate a plan with it (planner plan MODEL --calibrate {path})",
            "hardware file": f"plan for it (planner plan MODEL --gpu-type {path})",
            "trace": "open it in Perfetto (ui.perfetto.dev) or chrome://tracing",
        }[kind]
        raise ModelFileError(
            f"{path} is a {kind} written by the planner, not a model; {use}; give a model file (.py) or a Hugging "
            "Face config.json"
        )
    from planner.capture import hf_config

    if "hf_config" in (overrides or {}):  # the key that names the file itself: it would plan another one
        raise ModelFileError(
            f"--set hf_config: that key is the path of the config the planner reads ({path}); give another "
            "config as the model file instead (planner plan OTHER/config.json ...)"
        )
    config = {"hf_config": str(path), **(overrides or {})}
    with quiet_torchao_import():  # transformers imports torchao where it is installed
        hf_config.check_config(config)  # a misspelt --set key refused now, in its own words
    return ModelFile(path, hf_config, None, config)


def _sizes(module: ModuleType, path: Path) -> Mapping[str, Mapping[str, Any]]:
    """The file's ``SIZES``, checked to be named config dicts with string keys (absent or None: no sizes).

    Raises:
        ModelFileError: SIZES of another shape (a list, a dict of non-dicts, non-string names), which
            would otherwise fail later as a TypeError deep inside the lookup.
    """
    sizes = getattr(module, "SIZES", None)
    if sizes is None:
        return {}
    example = 'e.g. SIZES = {"tiny": {"n_layers": 2}, "big": {"n_layers": 24}}'
    if not isinstance(sizes, Mapping):
        raise ModelFileError(
            f"{path.name}: SIZES has type {type(sizes).__name__}; it must be a dict of named configs, {example}"
        )
    for key, cfg in sizes.items():
        if not isinstance(key, str):
            problem = f"SIZES has the name {key!r}, which is not a string"
        elif not isinstance(cfg, Mapping):
            problem = f"SIZES[{key!r}] has type {type(cfg).__name__}, not a dict of config entries"
        elif not all(isinstance(k, str) for k in cfg):
            problem = f"SIZES[{key!r}] has a config key that is not a string"
        else:
            continue
        raise ModelFileError(f"{path.name}: {problem}; {example}")
    return sizes


def _takes_any_key(module: ModuleType) -> bool:
    """``build_model(..., **config)`` with a name that does not start with ``_``: it uses keys it does not
    name (passes them on to a Hugging Face config, say), so ``--set`` may give any key; ``**_ignored``
    says the opposite, as the shipped files do."""
    try:
        params = inspect.signature(module.build_model).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD and not p.name.startswith("_") for p in params)


def _known_keys(module: ModuleType, sizes: Mapping[str, Mapping[str, Any]]) -> set[str]:
    keys = {k for cfg in sizes.values() for k in cfg}
    for fn_name in ("build_model", "make_batch", "train_batches"):
        fn = getattr(module, fn_name, None)
        if fn is None:
            continue
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # not callable, or a builtin without a signature: it names no keys
            continue
        for param in params:
            if param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD) and param.name != "batch_size":
                keys.add(param.name)
    return keys


def move_model(
    model: nn.Module, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """``model.to(device, dtype)``, with a buffer that several modules share still shared afterwards.

    ``nn.Module.to`` converts parameters in place (a tied weight stays one object) but gives every
    module its own converted copy of each buffer, so a table registered in every layer (Llama's
    rotary ``cos``/``sin``) becomes one tensor per layer. The fx tracer names a tensor after the
    first module that holds it, so the moved model traced into other ``get_attr`` nodes than the
    model as built: a plan profiled on a GPU, or estimated in bf16 on the meta device, had another
    fingerprint than the model ``planner run`` builds on the CPU, and was refused.

    Args:
        model: the model (moved in place, as ``Module.to`` does).
        device: where to; None keeps each tensor's device.
        dtype: floating dtype to convert to; None keeps dtypes.

    Returns:
        ``model``.
    """
    holders: dict[int, list[str]] = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        holders.setdefault(id(buf), []).append(name)
    model.to(device=device, dtype=dtype)
    for names in holders.values():
        first = model.get_buffer(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    return model

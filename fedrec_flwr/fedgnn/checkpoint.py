"""Server checkpoints of a FedGNN run: save atomically, load without executing code, check every field, compare configs.

Checkpoints are read with `torch.load(weights_only=True)`, which unpickles only tensors and plain
containers, so a crafted file cannot run code on the server. A missing, empty, truncated or
foreign file gives one CheckpointError naming the file and what was expected.

Every field the server restores (`FedGNNServer.state`, `FedGNNRounds.checkpoint_state`) is then checked
before anything is restored, so a damaged or foreign checkpoint fails with one line naming the field:
its type (`check_types`: dense tensors, integers, lists of the right kind), and its shape (`check_shapes`)
against the model and item table a config describes (`StateShapes`). `Checkpointer.load` checks the
shapes against the checkpoint's own config (the strategy then requires that config to be the run's,
`config_diff`); given `expect=StateShapes.of(run config, num_items, num_users, features)` it checks
them against the run's config and dataset sizes too, as `fedrec run` does before it starts a resumed run.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from fedrec_flwr.fsutil import atomic_write

CHECKPOINT_FILE = "server.pt"
# what a FedGNN server checkpoint must hold
REQUIRED_KEYS = ("model", "items", "model_opt", "item_opt", "torch_rng", "logical_round", "train_rounds_done",
                 "rounds_not_applied", "history", "rejections", "eval_rejected", "config")
# each privacy mode's ledger adds its own keys ("uploads": per-user upload counts; "user_dp_noise" and
# "user_dp_evaluations": the released sums), checked here where present and required by the mode on resume
# config sections that may differ between a killed run and its resumption
RESUME_FREE = ("checkpoint", "output_dir", "faults")
_ALWAYS_BUILT = 2**24  # values of a model the loader builds to compare shapes, whatever the file holds (64 MiB)


def checkpoint_folder(cfg) -> Path:
    """Where a run's checkpoints go: `checkpoint.dir`, else `<output_dir>/checkpoint` (a relative one is read
    against the working directory; `fedrec run` resolves a flwr run's against the project first)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.output_dir) / "checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what was expected."""


def _describe(value: Any) -> str:
    """A short account of a value for messages: a tensor's dtype and shape, else its type (and small value)."""
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout == torch.strided else f"{value.layout} "
        return f"a {layout}{str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (bool, int, float)) or value is None:
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40])
    return f"a {type(value).__name__}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dense(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


@dataclass(frozen=True)
class StateShapes:
    """What the model and item table of one run look like: the checkpoint's tensors must match.

    `params`: the model's parameters in order (name, shape), as `build_model` makes them; `row_width`: the
    item table's width (`models.row_width`); `num_items` / `num_users`: the dataset's sizes (None: unknown,
    the item table's own rows then set the item count); `source`: where the expectation comes from.
    """

    params: tuple[tuple[str, tuple[int, ...]], ...]
    row_width: int
    num_items: int | None = None
    num_users: int | None = None
    source: str = "the run's config"

    @classmethod
    def of(cls, config: Mapping[str, Any], num_items: int | None = None, num_users: int | None = None,
           num_item_features: int = 0, source: str = "the run's config") -> "StateShapes":
        """The shapes of the server a config's `model` section (a `to_dict` form) builds for this dataset."""
        from fedrec_flwr.config import ModelConfig
        from fedrec_flwr.models.rating_gnn import build_model, row_width

        model_cfg = ModelConfig(**dict(config["model"]))
        model = build_model(model_cfg, 0.0, num_item_features)
        return cls(tuple((name, tuple(p.shape)) for name, p in model.named_parameters()), row_width(model_cfg),
                   num_items, num_users, source)


def check_types(path: Path, state: dict[str, Any]) -> None:
    """CheckpointError naming the first field of a server checkpoint whose type or value range is not the one
    this app writes."""
    def fail(key: str, value: Any, expected: str) -> None:
        raise CheckpointError(f"{path}: key '{key}' = {_describe(value)}; expected {expected}")

    model = state["model"]
    if not isinstance(model, dict) or not all(isinstance(k, str) and _dense(v) for k, v in model.items()):
        bad = next(((k, v) for k, v in model.items() if not (isinstance(k, str) and _dense(v))), None) \
            if isinstance(model, dict) else None
        fail(f"model.{bad[0]}" if bad else "model", bad[1] if bad else model,
             "the model's state dict (parameter name -> dense tensor)")
    items = state["items"]
    if not _dense(items) or items.ndim != 2 or not items.is_floating_point():
        fail("items", items, "the item table: a dense 2-D floating-point tensor (items x row width)")
    for key in ("model_opt", "item_opt"):
        if not isinstance(state[key], dict):
            fail(key, state[key], "an optimiser state dict")
    rng, want_rng = state["torch_rng"], torch.get_rng_state()
    if not _dense(rng) or rng.dtype != torch.uint8 or tuple(rng.shape) != tuple(want_rng.shape):
        fail("torch_rng", rng, f"torch's CPU generator state: a uint8 tensor of shape {tuple(want_rng.shape)}")
    logical, done, skipped = state["logical_round"], state["train_rounds_done"], state["rounds_not_applied"]
    if not _is_int(logical) or logical < 1:
        fail("logical_round", logical, "an integer >= 1 (the round the checkpoint was written after)")
    if not _is_int(done) or not 0 <= done <= logical:
        fail("train_rounds_done", done, f"an integer in [0, logical_round = {logical}]")
    if not _is_int(skipped) or not 0 <= skipped <= done:
        fail("rounds_not_applied", skipped, f"an integer in [0, train_rounds_done = {done}]")
    if not _is_int(state["eval_rejected"]) or state["eval_rejected"] < 0:
        fail("eval_rejected", state["eval_rejected"], "an integer >= 0")
    history = state["history"]
    if not isinstance(history, list) or not all(isinstance(r, dict) and all(isinstance(k, str) for k in r)
                                                for r in history):
        fail("history", history, "a list of round records (objects with string keys)")
    rejections = state["rejections"]
    if not isinstance(rejections, list) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and _is_int(r[0]) and isinstance(r[1], str)
            for r in rejections):
        fail("rejections", rejections, "a list of [round, reason] pairs (an integer and a string)")
    uploads = state.get("uploads", [])
    if not isinstance(uploads, list) or not all(_is_int(n) and n >= 0 for n in uploads):
        fail("uploads", uploads, "a list of per-user upload counts (integers >= 0)")
    noise = state.get("user_dp_noise", [])  # user_dp: [noise multiplier, rounds released at it] pairs
    if not isinstance(noise, list) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], float) and r[0] >= 0 and _is_int(r[1])
            and r[1] >= 0 for r in noise):
        fail("user_dp_noise", noise, "a list of [noise multiplier, rounds] pairs (a float >= 0 and an integer >= 0)")
    config = state["config"]
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        fail("config", config, "the run's config (an object with string keys)")
    popularity = state.get("popularity")
    if popularity is not None and (not _dense(popularity) or popularity.ndim != 1
                                   or not popularity.is_floating_point()):
        fail("popularity", popularity, "null or a dense 1-D floating-point tensor (one estimate per item)")


def _check_finite(path: Path, key: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{path}: key '{key}' holds NaN or infinite values; expected finite numbers")


def _check_optimiser(path: Path, key: str, opt: dict, param_shapes: list[tuple[int, ...]]) -> None:
    """The optimiser state of `len(param_shapes)` parameters: groups naming each parameter once, per-parameter
    buffers of the parameter's shape, finite."""
    n = len(param_shapes)
    groups, per_param = opt.get("param_groups"), opt.get("state")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{path}: key '{key}.param_groups' = {_describe(groups)}; expected a non-empty list of "
                              "parameter groups (a torch optimiser's state dict)")
    named: list[Any] = []
    for i, group in enumerate(groups):
        params, lr = group.get("params"), group.get("lr")
        if not isinstance(params, list):
            raise CheckpointError(f"{path}: key '{key}.param_groups[{i}].params' = {_describe(params)}; expected a "
                                  "list of parameter indices")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise CheckpointError(f"{path}: key '{key}.param_groups[{i}].lr' = {_describe(lr)}; expected a finite "
                                  "learning rate >= 0")
        named += params
    if not all(_is_int(p) for p in named) or sorted(named) != list(range(n)):
        raise CheckpointError(f"{path}: key '{key}.param_groups' names parameters {named[:12]}; expected each of the "
                              f"{n} parameters 0..{n - 1} once")
    if not isinstance(per_param, dict):
        raise CheckpointError(f"{path}: key '{key}.state' = {_describe(per_param)}; expected an object "
                              "(parameter index -> its buffers)")
    for index, buffers in per_param.items():
        if not _is_int(index) or not 0 <= index < n or not isinstance(buffers, dict):
            raise CheckpointError(f"{path}: key '{key}.state' has entry {index!r}: {_describe(buffers)}; expected "
                                  f"parameter indices in [0, {n}) mapping to their buffers")
        for name, value in buffers.items():
            where = f"{key}.state[{index}].{name}"
            if name == "step":
                if not (_is_int(value) or isinstance(value, float) or (_dense(value) and value.numel() == 1)):
                    raise CheckpointError(f"{path}: key '{where}' = {_describe(value)}; expected a step count")
                continue
            if not _dense(value) or tuple(value.shape) != param_shapes[index]:
                raise CheckpointError(f"{path}: key '{where}' = {_describe(value)}; expected a dense tensor of shape "
                                      f"{param_shapes[index]} (parameter {index}'s)")
            _check_finite(path, where, value)


def check_shapes(path: Path, state: dict[str, Any], shapes: StateShapes) -> None:
    """CheckpointError naming the first tensor or list of a (type-checked) server checkpoint whose shape is not
    the one `shapes` describes: model parameters, item table, optimiser buffers, popularity, upload counts."""
    model = state["model"]
    want = dict(shapes.params)
    missing, extra = [k for k in want if k not in model], [k for k in model if k not in want]
    if missing or extra:
        raise CheckpointError(f"{path}: key 'model' has parameters {sorted(model)[:8]}; expected those of the model "
                              f"of {shapes.source} (missing {missing[:5]}, unexpected {extra[:5]})")
    for name, shape in shapes.params:
        if tuple(model[name].shape) != shape or not model[name].is_floating_point():
            raise CheckpointError(f"{path}: key 'model.{name}' = {_describe(model[name])}; expected a floating-point "
                                  f"tensor of shape {shape} (the model of {shapes.source})")
        _check_finite(path, f"model.{name}", model[name])
    items = state["items"]
    rows = shapes.num_items if shapes.num_items is not None else int(items.shape[0])
    if tuple(items.shape) != (rows, shapes.row_width):
        raise CheckpointError(f"{path}: key 'items' = {_describe(items)}; expected shape ({rows}, {shapes.row_width}): "
                              f"one row per item of width {shapes.row_width} ({shapes.source})")
    _check_finite(path, "items", items)
    _check_optimiser(path, "model_opt", state["model_opt"], [shape for _, shape in shapes.params])
    _check_optimiser(path, "item_opt", state["item_opt"], [(rows, shapes.row_width)])
    popularity = state.get("popularity")
    if popularity is not None:
        if tuple(popularity.shape) != (rows,):
            raise CheckpointError(f"{path}: key 'popularity' = {_describe(popularity)}; expected shape ({rows},): one "
                                  "estimate per item")
        _check_finite(path, "popularity", popularity)
    if shapes.num_users is not None and "uploads" in state and len(state["uploads"]) != shapes.num_users:
        raise CheckpointError(f"{path}: key 'uploads' holds the upload counts of {len(state['uploads'])} users; "
                              f"expected {shapes.num_users} ({shapes.source})")


def _own_shapes(path: Path, state: dict[str, Any]) -> StateShapes | None:
    """The shapes the checkpoint's own config describes (None when it carries no `model` section: then the
    strategy's config comparison refuses it). Its model is built only once its size is bounded by the
    tensors the file actually holds, so a crafted config cannot make the loader allocate without limit."""
    config = state["config"]
    model_cfg = config.get("model")
    if not isinstance(model_cfg, dict):
        return None
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    features = 0
    if data.get("item_features"):
        feature_map = state["model"].get("item_feature_map")
        features = int(feature_map.shape[0]) if _dense(feature_map) and feature_map.ndim == 2 else 1
    dim, heads = model_cfg.get("dim"), model_cfg.get("heads", 1)
    held = sum(int(t.numel()) for t in state["model"].values())
    # the encoder's weight alone holds dim x dim (x heads for GAT) values: a config far beyond what the file
    # holds is refused before its model is built (small models are built whatever the file holds)
    if not (_is_int(dim) and _is_int(heads) and dim >= 1 and heads >= 1) or \
            dim * dim * (heads if model_cfg.get("gnn") == "gat" else 1) > max(16 * held, _ALWAYS_BUILT):
        raise CheckpointError(f"{path}: key 'model' holds {held} values; expected the model its own config describes "
                              f"(config.model = {dict(model_cfg)})")
    try:
        return StateShapes.of(config, None, None, features, source="the checkpoint's own config")
    except Exception as exc:  # noqa: BLE001  (an unknown key, type or GNN kind in a foreign config)
        raise CheckpointError(f"{path}: key 'config.model' = {dict(model_cfg)}; expected this app's model settings "
                              f"({type(exc).__name__}: {exc})") from None


class Checkpointer:
    """Save and load one run's server checkpoint in `folder`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.folder / CHECKPOINT_FILE

    def save(self, state: dict[str, Any]) -> Path:
        """Write `state` (tensors, numbers, strings and containers of them) atomically."""
        buf = io.BytesIO()
        torch.save(state, buf)
        return atomic_write(self.path, buf.getvalue())

    def load(self, map_location: torch.device | str = "cpu", expect: StateShapes | None = None) -> dict[str, Any]:
        """The checkpoint's state, checked: the keys a FedGNN server checkpoint holds, each field's type
        (`check_types`) and shape (`check_shapes`) against `expect`, or else against the model the checkpoint's
        own config describes."""
        if not self.path.is_file():
            raise CheckpointError(f"checkpoint.resume is set but there is no checkpoint at {self.path}")
        try:
            state = torch.load(self.path, map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001  (torch raises many types for damaged or foreign files)
            raise CheckpointError(f"{self.path}: not a readable FedGNN checkpoint (expected a torch file of tensors "
                                  f"and plain values written by this app): {type(exc).__name__}: {exc}") from None
        if not isinstance(state, dict) or (missing := [k for k in REQUIRED_KEYS if k not in state]):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"{self.path}: not a FedGNN server checkpoint (expected keys {list(REQUIRED_KEYS)}; "
                                  f"found {found}, missing "
                                  f"{missing if isinstance(state, dict) else list(REQUIRED_KEYS)})")
        check_types(self.path, state)
        shapes = expect if expect is not None else _own_shapes(self.path, state)
        if shapes is not None:
            check_shapes(self.path, state, shapes)
        return state


def config_diff(now: dict[str, Any], then: dict[str, Any]) -> list[str]:
    """Config sections that differ between two runs, ignoring those a resumption may change."""
    keys = (set(now) | set(then)) - set(RESUME_FREE)
    return sorted(k for k in keys if now.get(k) != then.get(k))


def load_resumable(checkpointer: "Checkpointer", cfg: dict, num_items: int, num_users: int,
                   num_item_features: int, in_process: bool = False) -> dict:
    """The checkpoint's state, once it is known to be this run's: CheckpointError if it was written by the other
    kind of run (an in-process checkpoint holds its users' states, `user_states`; a flwr run's users keep theirs on
    their devices), with another config (by section), or its shapes differ from what this run's config and
    dataset give."""
    state = checkpointer.load()  # every field's type, and the shapes its own config describes
    if in_process != ("user_states" in state):
        written, resume = ("a flwr run", "flwr run") if in_process else ("an in-process run", "fedrec run --in-process")
        raise CheckpointError(f"checkpoint {checkpointer.path} was written by {written}, whose users' states "
                              f"{'are on the devices' if in_process else 'are in the file'}; resume it with {resume}")
    if diff := config_diff(cfg, state["config"]):
        raise CheckpointError(f"checkpoint {checkpointer.folder} was written with a different config (sections {diff})")
    check_shapes(checkpointer.path, state, StateShapes.of(cfg, num_items, num_users, num_item_features,
                                                          source="this run's config and dataset"))
    return state

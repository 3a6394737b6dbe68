"""One FedGNN user device, without Flower: its star subgraph, a GNN copy and its private embedding.

The user's embedding and ratings never leave the device. What leaves is the LDP-protected
gradient of the shared model and of the item rows of its anonymity set (rated, test and
pseudo items together, sorted by id), see `fedrec_flwr.fedgnn.protocol`. This module needs only
torch (not torch-geometric, not flwr, not ray), so GPU benchmarks can drive it on machines without flwr or ray.
Its local step and protection are in `fedrec_flwr.fedgnn.local_step`; `clients.fedgnn` wraps both in Flower's
NumPyClient.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from fedrec_flwr.config import AppConfig, LocalTrainingConfig, ModelConfig, PrivacyConfig
from fedrec_flwr.data import UserData
from fedrec_flwr.data.partition import PartitionMeta
from fedrec_flwr.fedgnn.protocol import ExpansionLink, RoundConfig
from fedrec_flwr.fedgnn.state import HANDLE_BYTES, UserState
from fedrec_flwr.metrics import ErrorSums, squared_error_sum
from fedrec_flwr.models.dense_star import DenseStars, dense_predict, population_predict
from fedrec_flwr.models.rating_gnn import RatingGNN, build_model, row_width
from fedrec_flwr.neighbours import NeighbourClient, item_tokens
from fedrec_flwr.privacy import (
    num_pseudo,
    sample_pseudo_items,
)
from fedrec_flwr.privacy.device_secret import DeviceSecret, simulation_secret
from fedrec_flwr.privacy.popularity import (
    inclusion_odds,
    oue_report,
    popularity_strata,
    sample_matched_pseudo,
)
from fedrec_flwr.privacy_modes import privacy_mode


@dataclass(frozen=True)
class DeviceSections:
    """What a FedGNN device reads of a run's config (the model, local training and privacy sections, and the CA
    file that the neighbour service's certificate must chain to), and its own secret, the source of every
    privacy draw: never the run seed, which the server holds."""

    model: ModelConfig
    local: LocalTrainingConfig
    privacy: PrivacyConfig
    secret: DeviceSecret
    ca_file: str = ""

    @classmethod
    def from_config(cls, cfg: AppConfig, secret: DeviceSecret | None = None) -> "DeviceSections":
        """The device's sections of a whole AppConfig, with `secret`. Without one (in-process runs, benchmarks and
        tests, where the config is the experimenter's own): the simulation's fixed secret of
        `simulation.device_secrets`, else a fresh one from the OS. A Flower client always passes its own."""
        return cls(cfg.model, cfg.local, cfg.privacy, secret or simulation_secret(cfg.simulation.device_secrets),
                   cfg.expansion.ca_file)


class UserStore(Protocol):
    """Where a node keeps its users' states between rounds (`MemoryStore`, `clients.user_store.NodeStateStore`)."""

    def begin_round(self, round_config: RoundConfig) -> None:
        """Take note of the round the server announced (checkpoint and resume marks)."""

    def load(self, user: int) -> UserState | None:
        """The stored state of `user`, or None before its first round."""

    def save(self, user: int, st: UserState, server_round: int = 0) -> None:
        """Keep `user`'s state after `server_round`."""

    def draw_attempt(self, user: int, server_round: int) -> int:
        """How many times `user` has drawn for `server_round` before (0 the first time), counting this one: a server
        that sends the same round again gets fresh draws, never the same noise on another model."""

    def committed_set(self, user: int) -> np.ndarray | None:
        """The anonymity set `user` registered with first on this device (any run), or None."""

    def commit_set(self, user: int, ids: np.ndarray) -> None:
        """Keep `ids` as `user`'s committed anonymity set (`FedGNNUser.register`)."""


class MemoryStore:
    """A UserStore over a dict: for tests and for driving users without Flower."""

    def __init__(self):
        self.states: dict[int, UserState] = {}
        self.draws: dict[tuple[int, int], int] = {}
        self.sets: dict[int, np.ndarray] = {}

    def committed_set(self, user: int) -> np.ndarray | None:
        """The set `commit_set` kept for `user`, or None."""
        return self.sets.get(user)

    def commit_set(self, user: int, ids: np.ndarray) -> None:
        """Keep `user`'s anonymity set for its later registrations."""
        self.sets[user] = np.asarray(ids, np.int64).copy()

    def begin_round(self, round_config: RoundConfig) -> None:
        """Nothing to note: a memory store lives exactly as long as its run."""

    def load(self, user: int) -> UserState | None:
        """The stored state of `user`, or None."""
        st = self.states.get(user)
        return None if st is None else st.copy()

    def save(self, user: int, st: UserState, server_round: int = 0) -> None:
        """Keep a copy of `user`'s state."""
        self.states[user] = st.copy()

    def draw_attempt(self, user: int, server_round: int) -> int:
        """The draws `user` made for `server_round` before this one (`UserStore.draw_attempt`)."""
        seen = self.draws.get((user, server_round), 0)
        self.draws[(user, server_round)] = seen + 1
        return seen


def user_rng(secret: DeviceSecret, user: int, *stream: int) -> np.random.Generator:
    """One user's secure stream for one purpose (`stream`): ChaCha20 keyed by the device secret, so only the device
    can compute it, and a simulation that fixes its devices' secrets replays it bit for bit."""
    return secret.generator(user, *stream)


def own_items(data: UserData) -> np.ndarray:
    """The items a user has ratings for (train and test), sorted: what its anonymity set must hide."""
    return np.union1d(data.train_items, data.test_items)


def popularity_report(cfg: DeviceSections, meta: PartitionMeta, data: UserData) -> np.ndarray:
    """The user's LDP report of its items (popularity-matched sampler), drawn from its own secure stream 2."""
    return oue_report(user_rng(cfg.secret, data.user, 2), own_items(data), meta.num_items,
                      cfg.privacy.popularity_epsilon)


def init_user_state(cfg: DeviceSections, meta: PartitionMeta, data: UserData,
                    popularity: np.ndarray | None = None) -> UserState:
    """Draw the user's embedding and its fixed pseudo items (once, on the device), and start its private offset.

    `popularity`: the item counts the server published, required by the popularity-matched sampler.
    The offset starts at 0, or with model.user_offset_init = "mean" at `initial_offset`: the user's own
    mean rating minus the model's starting bias, read from its own ratings on the device (no privacy cost).
    """
    rng = user_rng(cfg.secret, data.user, 0)
    emb = (rng.standard_normal(cfg.model.dim) * cfg.model.init_std).astype(np.float32)
    own = own_items(data)
    p = cfg.privacy
    # no anonymity set: the whole table down, an update over all of it
    if privacy_mode(p.mode).part("Device").whole_table:
        pseudo = own = np.zeros(0, np.int64)
    elif p.pseudo_sampler == "popularity":
        if popularity is None or np.shape(popularity) != (meta.num_items,) or not np.all(np.isfinite(popularity)):
            raise ValueError(f"the popularity-matched sampler needs the published counts of all {meta.num_items} items")
        pseudo = sample_matched_pseudo(rng, own, popularity_strata(popularity, p.popularity_bins), p.pseudo_ratio,
                                       inclusion_odds(popularity, meta.num_users))
    else:
        pseudo = sample_pseudo_items(rng, meta.num_items, own,
                                     num_pseudo(p.pseudo_items, own.size, meta.num_items - own.size))
    handle = rng.bytes(HANDLE_BYTES).hex()  # private randomness: the service cannot link it to the user id
    return UserState(emb, np.union1d(own, pseudo).astype(np.int64), np.zeros((0, cfg.model.dim), np.float32), handle,
                     initial_offset(cfg.model, meta, data))


def initial_offset(model: ModelConfig, meta: PartitionMeta, data: UserData) -> float:
    """Where the user's private rating offset starts: 0 ("zero"), or ("mean") its own mean training rating
    minus the model's starting global bias (the scale's midpoint, in the reference units the device reads),
    so that a model whose dot products are still ~0 first predicts the user's own mean.

    With model.user_offset_reg = k the start is shrunk as the trained offset is, by n / (n + k) for a user with n
    training ratings, so a light user's first predictions do not rest on its few ratings alone.
    Computed on the device from the user's own ratings and never sent anywhere: it costs no privacy.
    A user without training ratings starts at 0.
    """
    n = data.train_values.size
    if model.user_offset_init != "mean" or n == 0:
        return 0.0
    return float(n / (n + model.user_offset_reg) * (np.mean(data.train_values, dtype=np.float64)
                                                      - meta.scale.midpoint))


def ready(model: RatingGNN, device: torch.device, training: bool) -> RatingGNN:
    """`model` on `device` in train or eval mode, touched only where it differs: `Module.to` and `train()`
    walk every submodule even when nothing changes, which is a visible share of a simulated node's round."""
    first = next(model.parameters(), None)
    if first is not None and first.device != device:
        model = model.to(device)
    if model.training != training:
        model.train(training)
    return model


DOWNLOAD_BOUND = 1e6  # no honest model weight or item row comes near it


def check_download(arrays: list[np.ndarray]) -> None:
    """ValueError unless every value the server sent is finite and within DOWNLOAD_BOUND. Checked before any user's
    data is touched: a NaN or huge value in one item row would otherwise turn exactly the updates (or error sums) of
    the users who rated it non-finite, which no noise hides; refusing on the download alone reveals nothing. Values
    within the bound can still overflow a step (weights scaled up to it): that step is sent as no step
    (`local_step.protect`) and a NaN prediction is scored as the scale's midpoint (`metrics.clip_to_scale`)."""
    for a in arrays:
        a = np.asarray(a)
        if a.dtype.kind != "f":
            raise ValueError(f"the server's download holds a {a.dtype} array; model weights and rows are floats")
        if a.size and not (np.isfinite(a).all() and np.abs(a).max() <= DOWNLOAD_BOUND):
            raise ValueError(f"the server's download holds non-finite values or values past {DOWNLOAD_BOUND:g}")


def set_weights(model: RatingGNN, arrays: list[np.ndarray]) -> None:
    """Load the server's model weights into `model` (parameters in registration order), checked (`check_download`)."""
    params = list(model.parameters())
    if len(arrays) != len(params):
        raise ValueError(f"expected {len(params)} model arrays, got {len(arrays)}")
    check_download(arrays)
    with torch.no_grad():
        for p, a in zip(params, arrays):
            p.copy_(torch.from_numpy(np.asarray(a)).reshape(p.shape))


def _features_of(data: UserData, items: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """The public features of `items` from the catalogue the user holds, or None without features."""
    if data.item_features is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(data.item_features[items])).to(device)


def row_positions(state: UserState, items: np.ndarray, whole_table: bool) -> np.ndarray:
    """Where the rows of `items` (sorted ids) sit in what the server sent the user: the whole item table under
    user-level DP (`whole_table`: row = item id), else the rows of its anonymity set (sorted ids)."""
    return items if whole_table else np.searchsorted(state.anonymity_ids, items)


def evaluate_user(
    model: RatingGNN, state: UserState, data: UserData, item_rows: np.ndarray, low: float, high: float,
    device: torch.device | None = None, whole_table: bool = False, error_clip: float = float("inf"),
    personal_shrink: float = 0.0,
) -> ErrorSums:
    """(SSE, SAE, n) of the user's clipped predictions on its own test ratings (item rows of `row_width`).

    Every test rating is scored. The prediction is the model's population part (`population_predict`: the global bias
    and the items' own terms, what every user shares) plus the user's own part (dot product, user bias, private
    offset) weighted by n / (n + k), n the user's training ratings and k = `personal_shrink` (model.personal_shrink):
    the own part of a user with 3 ratings rests on 3 ratings, and is trusted as much. k = 0: the full prediction. A
    user without training ratings (cold) and without neighbours has nothing of its own but its embedding as drawn:
    with model.population_bias (a population part trained to stand alone) it predicts that part alone; a cold user
    with neighbours keeps its full prediction (its neighbours are all it has of its own).
    """
    if data.test_items.size == 0:
        return ErrorSums(0.0, 0.0, 0)
    device = device or torch.device("cpu")
    model = ready(model, device, training=False)
    def rows(items: np.ndarray) -> torch.Tensor:  # `item_rows`: the whole table, or the anonymity set's rows
        return torch.from_numpy(item_rows[row_positions(state, items, whole_table)])

    train_x, query_x = rows(data.train_items).to(device), rows(data.test_items).to(device)
    t = data.train_items.size
    own = t / (t + personal_shrink) if personal_shrink and t else 1.0  # t = 0: its neighbours are its own part
    if t == 0 and state.neighbours.shape[0] == 0 and model.population_bias is not None:
        own = 0.0  # cold and alone, with a population part trained to stand alone
    with torch.no_grad():
        query_x = model.item_input(query_x, _features_of(data, data.test_items, device))
        population = population_predict(model, *model.split_rows(query_x)) if own < 1 else None
        if own == 0:  # cold and alone: no taste of its own to read
            return squared_error_sum(population.cpu().numpy(), data.test_values, low, high, error_clip)
        train_x = model.item_input(train_x, _features_of(data, data.train_items, device))
        # one star: the query items hang off the user (they receive from it, and the mask keeps them out of its message)
        items, b_items = model.split_rows(torch.cat([train_x, query_x], 0))
        mask = torch.cat([torch.ones(t, device=device), torch.zeros(data.test_items.size, device=device)])
        neigh_x = torch.from_numpy(state.neighbours).to(device)
        star = DenseStars(torch.from_numpy(state.embedding[None, :]).to(device), items[None], neigh_x[None], mask[None],
                          torch.ones(1, neigh_x.shape[0], device=device))
        params = {name: p[None] for name, p in model.named_parameters()}  # one user: a batch of one
        pred = dense_predict(model, params, star, star, None if b_items is None else b_items[None])[0, t:]
        pred = pred + np.float32(state.offset)
        if population is not None:
            pred = population + own * (pred - population)
    return squared_error_sum(pred.cpu().numpy(), data.test_values, low, high, error_clip)


class FedGNNUser:
    """One user's device logic. `store` persists its UserState between rounds (the device's own state)."""

    def __init__(self, cfg: DeviceSections, meta: PartitionMeta, data: UserData, store,
                 device: torch.device | None = None, model: RatingGNN | None = None):
        self.cfg, self.meta, self.data, self.store = cfg, meta, data, store
        self.device = device or torch.device("cpu")
        self.model = model if model is not None else build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
        self._state: UserState | None = store.load(data.user)
        self._round_key: tuple[int, int] | None = None

    @property
    def state(self) -> UserState:
        """The user's state: stored, or drawn now (the uniform sampler needs nothing from the server), its anonymity
        set the one this device committed to (`_committed_state`)."""
        if self._state is None:
            self._state = self._committed_state(None)
        return self._state

    def _committed_state(self, popularity: np.ndarray | None) -> UserState:
        """A fresh state whose anonymity set is the one this device committed to first (any run, any phase that
        draws it: registration or a training message that comes first): that set again, or (new ratings outside
        it) that set joined with a fresh draw; a first draw is committed now. A server that changes the published
        popularity or the pseudo-item settings between runs, and intersects the sets, learns nothing new."""
        st = init_user_state(self.cfg, self.meta, self.data, popularity)
        if not st.anonymity_ids.size:  # user-level DP: no anonymity set
            return st
        committed = self.store.committed_set(self.user)
        if committed is not None:
            keep = np.isin(own_items(self.data), committed).all()
            st.anonymity_ids = committed if keep else np.union1d(committed, st.anonymity_ids).astype(np.int64)
        self.store.commit_set(self.user, st.anonymity_ids)
        return st

    @state.setter
    def state(self, st: UserState) -> None:
        self._state = st

    @property
    def user(self) -> int:
        """The user's id (known to the recommendation server, which knows who its clients are)."""
        return self.data.user

    @property
    def whole_table(self) -> bool:
        """Whether the server sends this user the whole item table (by the privacy mode) rather than its anonymity set's
        rows."""
        return privacy_mode(self.cfg.privacy.mode).part("Device").whole_table

    def item_rows(self, rows: np.ndarray) -> np.ndarray:
        """The server's rows of this user's anonymity set as float32, checked against the set's shape."""
        rows = np.asarray(rows, np.float32)
        expected = (self.meta.num_items if self.whole_table else self.state.anonymity_ids.size,
                    row_width(self.cfg.model))
        if rows.shape != expected:
            raise ValueError(f"item rows have shape {rows.shape}, expected {expected}")
        check_download([rows])
        return rows

    @property
    def registered_test_count(self) -> int:
        """What this user commits at registration: its test count, or 0 under user-level DP, where the count is
        private too and evaluations go through the noisy secure sum instead."""
        return 0 if self.whole_table else self.test_count

    @property
    def test_count(self) -> int:
        """How many test ratings this user holds: committed at registration, and what its evaluations report as n."""
        return int(self.data.test_items.size)

    def report_popularity(self) -> np.ndarray:
        """Round 0 of the popularity-matched sampler: the LDP report of this user's items."""
        return popularity_report(self.cfg, self.meta, self.data)

    def register(self, popularity: np.ndarray | None = None) -> np.ndarray:
        """The anonymity set this user will upload rows for (item ids only; int32 halves the message).

        A user registering for the first time draws its set now, from the `popularity` the server
        published when the sampler needs it, within the set this device committed to (`_committed_state`); a
        stored user (a resumed run) keeps the set it had.
        """
        if self._state is None:
            self._state = self._committed_state(popularity)
        self.store.save(self.user, self.state)
        return self.state.anonymity_ids.astype(np.int32)

    def expand(self, link: ExpansionLink, retries: int, submit: bool, fetch: bool, server_round: int = 0) -> int:
        """Talk to the neighbour service directly: send embedding + keyed item tokens, get neighbours.

        A user without rated items can share an item with nobody: it keeps no neighbours and does
        not contact the service (an empty token list is malformed there).
        """
        if self.data.train_items.size == 0:
            return 0
        client = NeighbourClient(link.address, retries=retries, token=link.secret or None,
                                 ca_file=self.cfg.ca_file or None)
        if submit:
            client.submit(link.run_id, self.state.handle, self.state.embedding,
                          item_tokens(link.key, self.data.train_items))
        if fetch:
            self.state.neighbours = client.neighbours(link.run_id, self.state.handle,
                                                      dim=self.cfg.model.dim).astype(np.float32)
        self.store.save(self.user, self.state, server_round)
        return int(self.state.neighbours.shape[0])

    def round_key(self, server_round: int) -> tuple[int, int]:
        """(round, attempt): what this user's streams of a round are keyed by. The attempt counts the times the
        server asked for this round before (the store keeps it), so a repeated round never repeats a draw; taken
        once per round and object, so the round's coin, noise and training streams share it."""
        if self._round_key is None or self._round_key[0] != server_round:
            self._round_key = (server_round, self.store.draw_attempt(self.user, server_round))
        return self._round_key

    def stream(self, purpose: int, server_round: int) -> np.random.Generator:
        """This user's secure stream for `purpose` in `server_round` (keyed by `round_key`)."""
        return user_rng(self.cfg.secret, self.user, purpose, *self.round_key(server_round))

    def begin_train(self, server_round: int,
                    round_config: RoundConfig | None = None) -> tuple[np.random.Generator, int]:
        """Start this user's training round: refresh its neighbours if the round asks, and return its secure stream
        for the round (stream 1) with the seed of its dropout masks, drawn first from it."""
        if round_config is not None and round_config.refresh_neighbours and round_config.expansion is not None:
            self.expand(round_config.expansion, round_config.retries, submit=True, fetch=True,
                        server_round=server_round)
        rng = self.stream(1, server_round)
        return rng, int(rng.integers(2**62))

    def finish_train(self, embedding: np.ndarray, offset: float, server_round: int) -> None:
        """Keep the round's new private state (embedding and offset) after its local step. A step that overflowed or
        left the state past DOWNLOAD_BOUND (a download within the bounds can do it to the raters of an item alone)
        leaves the state as it was: the state is sent to the neighbour service and feeds every later step."""
        embedding = np.asarray(embedding, np.float32)
        # NaN and inf fail the bound too (every comparison with NaN is false)
        if np.abs(embedding).max(initial=0.0) <= DOWNLOAD_BOUND and abs(offset) <= DOWNLOAD_BOUND:
            self.state.embedding = embedding
            self.state.offset = float(offset)
        self.store.save(self.user, self.state, server_round)

    def evaluate(self, weights: list[np.ndarray], rows: np.ndarray, error_clip: float = float("inf"),
                 personal_shrink: float | None = None, items: np.ndarray | None = None) -> ErrorSums:
        """(SSE, SAE, n) on the user's own test ratings (each error clipped to +-error_clip). A simulation's analyses:
        `personal_shrink`, the k to predict with (None: the config's model.personal_shrink); `items`, score only the
        test ratings of these items (a test item never enters the user's message, so each keeps its prediction)."""
        set_weights(self.model, weights)
        k = self.cfg.model.personal_shrink if personal_shrink is None else personal_shrink
        data = self.data
        if items is not None:
            keep = np.isin(data.test_items, items)
            data = replace(data, test_items=data.test_items[keep], test_values=data.test_values[keep])
        return evaluate_user(self.model, self.state, data, self.item_rows(rows), self.meta.scale.low,
                             self.meta.scale.high, self.device, whole_table=self.whole_table, error_clip=error_clip,
                             personal_shrink=k)

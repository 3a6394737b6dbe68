"""FedGNN's users and round core in one process, without Flower or Ray (`fedrec run --in-process`).

Used by tests, hyper-parameter sweeps and device (GPU) checks: the same user code and the same round
core as a `flwr run` (`fedrec_flwr.fedgnn.user`, `fedrec_flwr.fedgnn.rounds`), with messages passed
as Python lists instead of over Flower, every user on a node of its own. Graph expansion runs as under
`flwr run`: the same schedule, a neighbour service process on loopback (or the configured one), and each
user talking to it over HTTP. Imports neither flwr nor ray.

Checkpoints as under `flwr run`: every `checkpoint.every` training rounds the round core's state, the run's
history and every user's stored state go to `checkpoint.dir` (default `<output_dir>/checkpoint`), and
`checkpoint.resume = true` continues from there with the numbers the uninterrupted run gives.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from fedrec_flwr.config import to_dict
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.accounting import sample_rate
from fedrec_flwr.fedgnn.bindings import NodeBindings
from fedrec_flwr.fedgnn.checkpoint import Checkpointer, CheckpointError, checkpoint_folder, load_resumable
from fedrec_flwr.fedgnn.expansion import open_expansion_link
from fedrec_flwr.fedgnn.local_step import train_users
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_TRAIN,
    ExpansionLink,
    RoundConfig,
    frame_registration,
    frame_train_upload,
    frame_users,
    published_popularity,
    split_download,
    split_table_download,
)
from fedrec_flwr.fedgnn.rounds import FedGNNRounds
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.state import UserState, decode_state, encode_state, user_state_problem
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore, own_items
from fedrec_flwr.fedgnn.user_dp import node_evaluation, node_update
from fedrec_flwr.messages import NodeReply
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy_modes import privacy_mode
from fedrec_flwr.reference.baselines import baseline_rmses, baselines_on_users
from fedrec_flwr.reporting.results import RunFailed, RunRecorder


def register_users(rounds: FedGNNRounds, users: list[int], user: Callable[[int], FedGNNUser],
                   resumed: bool = False) -> None:
    """Rounds before training, one node per user: popularity reports (if the sampler needs them; a resumed run has
    the published counts from its checkpoint), then registration (a resumed user keeps its stored set)."""
    devices = [user(u) for u in users]  # each built once: it reads the user's data
    if rounds.first_round == 0 and not resumed:
        rounds.popularity(0, [NodeReply(d.user, frame_users([d.user], [[d.report_popularity()]], 1)) for d in devices],
                          time.time())
    popularity = None if resumed else published_popularity(rounds.server.registration_download(),
                                                           rounds.server.num_items)
    rounds.register(1, [NodeReply(d.user, frame_registration([d.user], [d.register(popularity)],
                                                             [d.registered_test_count]))
                        for d in devices], time.time())


def run_in_process(cfg, device: torch.device | None = None, log_every: int = 5,
                   server_device: torch.device | None = None,
               probe: Callable[[FedGNNServer, Callable[..., float], Callable[[int], FedGNNUser]], dict] | None = None,
               tamper: Callable[[int, int, list[np.ndarray]], list[np.ndarray]] | None = None,
               record: bool = False, by_group: bool = False, group_shrinks: Sequence[float] = ()) -> dict:
    """Run cfg.federation.rounds FedGNN rounds in-process through the round core; returns metrics and timings.

    Every user sits on one node of its own (sampling is by user id, so the numbers are those of any
    `users_per_node`). `probe(server, rmse, device_user)`, if given, runs at every evaluation and its dict joins
    that round's record; `rmse(table, neighbours=True)` is the RMSE of all users evaluating against another item
    table, or (neighbours=False) with their expansion neighbours left out of their graphs; `device_user(u)` is
    user u's device, holding a copy of its state.
    `tamper(user, round, upload)`, if given, replaces each user's protected upload (poisoning benchmarks).
    Checkpoints and resumes by the config's `checkpoint` section (see the module's docstring); a resumed run's
    result has `resumed`: the logical round it continued after and the seconds its rounds had taken.
    `record`: write results.json and rounds.csv to `cfg.output_dir` with the baselines on the scored ratings, as a
    `flwr run` does (`fedrec run --in-process`), so `fedrec summary` and `fedrec plot` read it alike.
    `by_group`: the result also has `by_user_group`, the final model's exact error on the test ratings of each user
    group (`user_group_errors`: cold, light and the rest), and `by_item_group`, the same for the items by their
    training ratings (`item_group_errors`): where sparse variants lose their accuracy.
    `group_shrinks`: the result also has `by_user_group_at_shrink`, the same per group for each of these values of
    model.personal_shrink (keyed by the value as text): it weighs the prediction only, never the training, so this
    is exactly what the run with that value gives.
    """
    if any(k > 0 for k in group_shrinks) and not cfg.model.population_bias:
        raise ValueError(f"group_shrinks {list(group_shrinks)} weigh the population part, which needs "
                         "model.population_bias = true (as model.personal_shrink does)")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    recorder = baselines_of = None
    if record:
        ratings = parts.ratings()
        recorder = RunRecorder(cfg.output_dir, cfg.algorithm, meta.dataset, to_dict(cfg))
        recorder.set_baselines(baseline_rmses(ratings))

        def baselines_of(scored: list[int]) -> tuple[dict[str, float], int]:
            return baselines_on_users(ratings, scored)
    try:
        out = _run(cfg, parts, recorder, baselines_of, device, log_every, server_device, probe, tamper, by_group,
                   group_shrinks)
    except Exception as exc:
        if recorder is not None and not recorder.finished:
            recorder.fail(f"{type(exc).__name__}: {exc}")
        raise
    return out


def _run(cfg, parts: UserPartitions, recorder: RunRecorder | None, baselines_of, device, log_every: int,
         server_device, probe, tamper, by_group: bool = False, group_shrinks: Sequence[float] = ()) -> dict:
    """`run_in_process`'s body, with its recorder (None: nothing written)."""
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint, server_device, meta.num_item_features)
    rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(meta.num_users, block_size=1),
                                      meta.scale.span, recorder=recorder, test_ratings=meta.num_test,
                                      baselines=baselines_of)
    store = MemoryStore()
    checkpointer = Checkpointer(checkpoint_folder(cfg)) if cfg.checkpoint.every or cfg.checkpoint.resume else None
    resumed = None
    if cfg.checkpoint.resume:
        resumed = load_resumable(checkpointer, to_dict(cfg), meta.num_items, meta.num_users, meta.num_item_features,
                                 in_process=True)
        rounds.check_resume_point(checkpointer.path, resumed)
        store.states = checkpointed_users(checkpointer.path, resumed, parts, cfg, server.min_rows())
    device_cfg = DeviceSections.from_config(cfg)  # the simulation's fixed secret, or a fresh one
    # one device-side model, shared by users in turn
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)

    def user(u: int) -> FedGNNUser:
        return FedGNNUser(device_cfg, meta, parts.user(u), store, device, model)

    users = list(range(meta.num_users))  # every user registers, as under flwr run: cold users are scored too
    if rounds.is_secure(PHASE_TRAIN) and (tamper is not None or probe is not None):
        raise ValueError("tamper and probe read per-user uploads and anonymity sets, which a secure-sum "
                         "privacy mode has not")
    done, history, before = 1, [], 0.0  # registration is logical round 1
    if resumed is not None:
        history, before = checkpointed_history(checkpointer.path, resumed, len(rounds.schedule))
        done = rounds.restore(resumed)
        if log_every:
            print(f"[in-process] resumed from {checkpointer.path} after logical round {done} "
                  f"({rounds.train_rounds_done} training rounds done)", flush=True)
    link = open_expansion_link(cfg, meta.num_items) if cfg.expansion.mode != "none" else None
    try:
        register_users(rounds, users, user, resumed is not None)
        t_start = time.time()

        def save_checkpoint(logical_round: int) -> None:
            """Write the round core's state, the history so far and every user's state (after `logical_round`)."""
            checkpointer.save({**rounds.checkpoint_state(logical_round), "history": history, "config": to_dict(cfg),
                               "user_states": [_as_tensor(encode_state(store.states[u])) for u in users],
                               "elapsed_seconds": before + time.time() - t_start})

        _run_rounds(cfg, rounds, server, meta, users, user, link, device, log_every, probe, tamper, done + 1, history,
                    save_checkpoint if cfg.checkpoint.every else None)
        wall = before + time.time() - t_start
    finally:
        if link is not None and link.close_run is not None:
            link.close_run()
    why = rounds.failure()
    if why is not None:
        raise RunFailed(why)
    rounds.finish()  # with a recorder: results.json's final metrics and baselines, and the FINAL line
    train_secs = [h["round_seconds"] for h in history if "phase" not in h]
    unit = meta.dataset_scale.unit_factor
    groups = user_group_errors(server, users, user, parts, unit) if by_group else None
    by_items = item_group_errors(server, users, user, parts, unit) if by_group else None
    at_shrink = {f"{k:g}": user_group_errors(server, users, user, parts, unit, k) for k in group_shrinks}
    return {"by_user_group": groups, "by_item_group": by_items, "by_user_group_at_shrink": at_shrink or None,
            "rmse": history[-1].get("rmse"),
            "median_round_seconds": float(np.median(train_secs)),
            "clients_per_second": min(cfg.federation.clients_per_round, meta.num_users) / float(np.median(train_secs)),
            "wall_seconds": wall, "uploads_per_user": rounds.upload_counts(),
            "rejected": sum(h.get("rejected", 0) for h in history), "rounds_not_applied": rounds.rounds_not_applied,
            "eval_ratings": history[-1].get("eval_ratings", rounds.final["eval_ratings"]),
            "test_ratings": rounds.test_ratings,
            "eval_rejected": rounds.eval_rejections, "history": history,
            "resumed": None if resumed is None else {"after_round": resumed["logical_round"], "seconds_before": before}}


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


LIGHT_USER_RATINGS = 5  # a light user has 1 .. this many training ratings; a cold user none


def user_groups(parts: UserPartitions, users: list[int]) -> dict[str, list[int]]:
    """`users` by how many training ratings they hold: cold (none), light (1-5) and the rest."""
    counts = {u: parts.user(u).train_items.size for u in users}
    return {"cold": [u for u in users if counts[u] == 0],
            "light": [u for u in users if 0 < counts[u] <= LIGHT_USER_RATINGS],
            "rest": [u for u in users if counts[u] > LIGHT_USER_RATINGS]}


def _user_errors(server: FedGNNServer, users: list[int], user: Callable[[int], FedGNNUser],
                 **evaluate_args) -> dict[int, tuple[float, int]]:
    """Each user's (SSE, n) of the final model on its test ratings (`FedGNNUser.evaluate` with `evaluate_args`)."""
    weights, table = server.model_weights(), server.table()
    whole = server.device_mechanism.whole_table
    out = {}
    for u in users:
        sse, _, n = user(u).evaluate(weights, table if whole else table[server.anonymity_sets[u]], **evaluate_args)
        out[u] = (sse, n)
    return out


def _rmse_of(errors: dict[int, tuple[float, int]], members, unit_factor: float) -> tuple[float | None, int]:
    """(RMSE on the dataset's own scale or None without ratings, ratings) of `members`' summed `errors`."""
    sse, n = sum(errors[u][0] for u in members), sum(errors[u][1] for u in members)
    return (float(np.sqrt(sse / n)) * unit_factor if n else None), n


def user_group_errors(server: FedGNNServer, users: list[int], user: Callable[[int], FedGNNUser],
                      parts: UserPartitions, unit_factor: float,
                      personal_shrink: float | None = None) -> dict[str, dict]:
    """The final model's RMSE on every test rating of each user group (`user_groups`), exact (a simulation's: no
    party of a deployment holds it), on the dataset's own scale; `users`, `test_ratings` and `rmse` per group.
    `personal_shrink`: predict with this model.personal_shrink instead of the run's (None: the run's)."""
    errors = _user_errors(server, users, user, personal_shrink=personal_shrink)
    out = {}
    for name, members in {"all": users, **user_groups(parts, users)}.items():
        rmse, n = _rmse_of(errors, members, unit_factor)
        out[name] = {"users": len(members), "test_ratings": n, "rmse": rmse}
    return out


# an item group holds the items with this many training ratings, lower bound included, up to the next group's
ITEM_GROUPS = {"unrated": 0, "1-4": 1, "5-19": 5, "20+": 20}


def item_groups(train_items: np.ndarray, num_items: int) -> dict[str, np.ndarray]:
    """The catalogue's items by how many training ratings they have (`ITEM_GROUPS`; `train_items`, the item of every
    training rating): where a sparse variant's item rows and the items' own terms have the least to learn from."""
    counts = np.bincount(train_items, minlength=num_items)
    bounds = list(ITEM_GROUPS.values()) + [np.iinfo(np.int64).max]
    ids = np.arange(num_items)
    return {name: ids[(counts >= lo) & (counts < hi)] for name, lo, hi in zip(ITEM_GROUPS, bounds, bounds[1:])}


def item_group_errors(server: FedGNNServer, users: list[int], user: Callable[[int], FedGNNUser],
                      parts: UserPartitions, unit_factor: float) -> dict[str, dict]:
    """The final model's RMSE on every test rating of each item group (`item_groups`), exact and on the dataset's
    own scale as `user_group_errors`; `items`, `test_ratings` and `rmse` per group."""
    out = {}
    for name, items in item_groups(parts.ratings().train.items, parts.meta.num_items).items():
        members = [u for u in users if np.isin(parts.user(u).test_items, items).any()]
        rmse, n = _rmse_of(_user_errors(server, members, user, items=items), members, unit_factor)
        out[name] = {"items": int(items.size), "test_ratings": n, "rmse": rmse}
    return out


def checkpointed_history(path: Path, state: dict, total: int) -> tuple[list[dict], float]:
    """The round records and wall seconds an in-process checkpoint holds, checked: one record per logical round
    after registration up to the checkpoint's (before the run's last), each with its seconds."""
    done, history, elapsed = state["logical_round"], state["history"], state.get("elapsed_seconds")
    if done >= total:
        raise CheckpointError(f"{path}: key 'logical_round' = {done}; expected a round before this run's "
                              f"last ({total})")
    if len(history) != done - 1 or not all(isinstance(h.get("round_seconds"), float) for h in history):
        raise CheckpointError(f"{path}: key 'history' holds {len(history)} records; expected {done - 1}, one per "
                              f"logical round from 2 to {done}, each with its round_seconds")
    if not isinstance(elapsed, float) or not (math.isfinite(elapsed) and elapsed >= 0):
        raise CheckpointError(f"{path}: key 'elapsed_seconds' = {elapsed!r}; expected the seconds the run had taken "
                              "(a finite float >= 0)")
    return list(history), elapsed


def checkpointed_users(path: Path, state: dict, parts: UserPartitions, cfg, min_rows: int) -> dict[int, UserState]:
    """Every user's state from an in-process checkpoint (`user_states`: one encoded UserState per user, as a
    uint8 tensor), each checked against the run and its user (`state.user_state_problem`) and their handles
    distinct: CheckpointError naming the first that does not fit."""
    blobs, meta = state["user_states"], parts.meta
    if not isinstance(blobs, list) or len(blobs) != meta.num_users:
        found = f"a list of {len(blobs)}" if isinstance(blobs, list) else type(blobs).__name__
        raise CheckpointError(f"{path}: key 'user_states' is {found}; expected one encoded user state per user "
                              f"({meta.num_users})")
    cap = cfg.expansion.max_neighbours if cfg.expansion.mode != "none" else 0
    states, handles = {}, set()
    for u, blob in enumerate(blobs):
        if (not isinstance(blob, torch.Tensor) or blob.layout != torch.strided or blob.dtype != torch.uint8
                or blob.ndim != 1):
            raise CheckpointError(f"{path}: key 'user_states[{u}]' is not a dense 1-D uint8 tensor (an "
                                  f"encoded user state)")
        try:
            st = decode_state(blob.numpy().tobytes())
        except ValueError as exc:
            raise CheckpointError(f"{path}: key 'user_states[{u}]': {exc}") from None
        problem = user_state_problem(st, dim=cfg.model.dim, num_items=meta.num_items, own=own_items(parts.user(u)),
                                     min_rows=min_rows,
                                     whole_table=privacy_mode(cfg.privacy.mode).part("Device").whole_table,
                                     max_neighbours=cap, offset=cfg.model.user_offset)
        if problem is None and st.handle in handles:
            problem = "the handle of another user; expected its own"
        if problem is not None:
            raise CheckpointError(f"{path}: key 'user_states[{u}]' holds {problem}")
        states[u] = st
        handles.add(st.handle)
    return states


def expand_users(rounds: FedGNNRounds, logical: int, phase: str, users: list[int], user: Callable[[int], FedGNNUser],
                 link: ExpansionLink, retries: int) -> dict:
    """One expansion round, every user at once: each submits to (or fetches its neighbours from) the service
    itself, as its device does under flwr run. Returns the round's record."""
    t0 = time.time()
    counts = [user(u).expand(link, retries, phase == PHASE_EXPAND_SUBMIT, phase == PHASE_EXPAND_FETCH, logical)
              for u in users]
    return rounds.record_expansion(logical, phase, len(users), sum(counts), t0)


def evaluate_secure_sum(cfg, rounds: FedGNNRounds, server: FedGNNServer, users: list[int],
                     user: Callable[[int], FedGNNUser], logical: int, started: float) -> dict:
    """A secure-sum evaluation round in-process, as its record: the released evaluation (every user its own node, all
    reporting: the N shares of sigma_e / sqrt(K) drawn as one; `FedGNNRounds.evaluate_sum`, charged) and, beside it, the
    exact RMSE of every test rating, which only a simulation can compute (no party of a deployment ever holds it)."""
    weights, table = server.model_weights(), server.table()
    everyone = [u for us in rounds.plan_evaluate_sum(set(users)).values() for u in us]
    std = rounds.mechanism.charged_multiplier(len(everyone), evaluation=True)
    vector = node_evaluation([user(u) for u in everyone], weights, table, logical, cfg.privacy.eval_max_ratings, std)
    released = rounds.evaluate_sum(logical, vector, len(everyone), [], started, 0.0, 0.0) or {}
    sse, n = 0.0, 0
    for u in everyone:
        s, _, k = user(u).evaluate(weights, table)
        sse, n = sse + s, n + k
    factor = rounds.unit_factor()
    return {"round": rounds.train_rounds_done, "phase": PHASE_EVALUATE_SUM, "round_seconds": time.time() - started,
            "rmse": float(np.sqrt(sse / n)) * factor if n else None, "eval_ratings": n,
            "released_rmse": released.get("rmse"), "released_mae": released.get("mae"),
            "rmse_is": "exact, every test rating (simulation only); released_rmse is what the server learns",
            "uploads_per_user": rounds.upload_counts(), "privacy": rounds.privacy_budget()}


def _run_rounds(cfg, rounds: FedGNNRounds, server: FedGNNServer, meta, users: list[int],
                user: Callable[[int], FedGNNUser], link: ExpansionLink | None, device, log_every: int, probe, tamper,
                first: int, history: list[dict], save_checkpoint: Callable[[int], None] | None) -> None:
    """Logical rounds `first` .. the last, by the run's schedule, their records appended to `history`;
    `save_checkpoint(round)` after every checkpoint.every-th training round but the last."""
    connected = set(users)  # node id = user id
    lifecycle = rounds.lifecycle
    total = lifecycle.last_round  # logical rounds 1 .. total: registration, training, expansion
    for rnd in range(first, total + 1):
        phase = rounds.phase(rnd)
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            history.append(expand_users(rounds, rnd, phase, users, user, link, cfg.expansion.retries))
            continue
        t0 = time.time()
        if phase == PHASE_EVALUATE_SUM:
            history.append(evaluate_secure_sum(cfg, rounds, server, users, user, rnd, t0))
            if log_every:
                print(f"[in-process] round {rounds.train_rounds_done} rmse {history[-1]['rmse']:.4f} (released "
                      f"{history[-1]['released_rmse']})", flush=True)
            continue
        # trainable expansion: each sampled user re-submits and re-fetches before it trains, once it has expanded
        round_config = (RoundConfig(phase=phase, round=rnd, expansion=link, retries=cfg.expansion.retries,
                                    refresh_neighbours=True) if lifecycle.refreshes_neighbours(rnd) else None)
        weights = server.model_weights()
        plan = rounds.plan_train(rnd, connected)  # node -> hosted users; the round's users train as one batch
        hosted = [u for us in plan.nodes.values() for u in us]
        if rounds.is_secure(phase):  # one node hosting every user: the same sum, and all N noise shares in one draw
            f = cfg.federation
            _, table, _ = split_table_download(rounds.download(hosted, weights), len(weights))
            # every user its own node, all reporting: the N shares of sigma C / sqrt(K) drawn as one
            std = rounds.mechanism.charged_multiplier(len(hosted)) * cfg.privacy.clip_norm
            vector = node_update([user(u) for u in hosted], weights, table, rnd, None, cfg.simulation.user_batch,
                                 sample_rate(f.clients_per_round, meta.num_users), std)
            out = rounds.train_sum(rnd, vector, len(hosted), len(hosted), [], t0, 0.0, 0.0)
        else:
            _, _, rows = split_download(rounds.download(hosted, weights), len(weights))
            uploads = dict(zip(hosted, train_users([user(u) for u in hosted], weights, rows, rnd, round_config,
                                                   cfg.simulation.user_batch)))
            replies = [NodeReply(node, frame_train_upload(us, [uploads[u] if tamper is None
                                                               else tamper(u, rnd, uploads[u])
                                                               for u in us])) for node, us in plan.nodes.items()]
            out = rounds.train(plan, replies, [], t0, 0.0)
        rec = {"round": rounds.train_rounds_done, "round_seconds": time.time() - t0, "clients": out["accepted"],
               "rejected": out["rejected"]}
        if rounds.evaluates_after(rnd):  # a mode that evaluates after training (others: evaluate-sum rounds, above)
            weights = server.model_weights()

            def rmse(table: np.ndarray | None = None, neighbours: bool = True) -> float:
                if table is None and neighbours:
                    replies, plan = [], rounds.plan_eval(rnd, connected)
                    for node, hosted in plan.nodes.items():
                        _, _, rows = split_download(rounds.download(hosted, weights), len(weights))
                        sse, sae, n = (sum(x) for x in zip(*(user(u).evaluate(weights, r)
                                                             for u, r in zip(hosted, rows))))
                        replies.append(NodeReply(node, metrics={"sse": sse, "sae": sae, "n": int(n)}))
                    return rounds.evaluate(plan, replies, 0)["rmse"]
                table = server.table() if table is None else table
                sse = n = 0.0
                for u in users:
                    device_user = user(u)  # holds a copy of the stored state
                    if not neighbours:  # the same user and model, its neighbours left out of its graph
                        device_user.state.neighbours = device_user.state.neighbours[:0]
                    s, _, k = device_user.evaluate(weights, table[server.anonymity_sets[u]])
                    sse, n = sse + s, n + k
                return float(np.sqrt(sse / n)) * meta.dataset_scale.unit_factor  # devices report reference units

            rec["rmse"] = rmse()
            rec["uploads_per_user"] = rounds.upload_counts()
            rec["privacy"] = rounds.privacy_budget()  # what each user has spent up to this round
            if probe is not None:
                rec.update(probe(server, rmse, user))
            if log_every:
                print(f"[in-process] round {rec['round']} rmse {rec['rmse']:.4f} ({rec['round_seconds']:.2f}s/round)",
                      flush=True)
        history.append(rec)
        if save_checkpoint is not None and rnd < total and lifecycle.checkpoints_after(rnd, rounds.train_rounds_done):
            save_checkpoint(rnd)

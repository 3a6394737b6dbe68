"""What FedGNN's privacy actually guarantees: the LDP mode per coordinate, per upload and per user over a run
(`LDPAccountant`), and the user-DP mode per user over a run (`UserDPAccountant`, at the end of this module).

Mechanism: every coordinate x of an upload is clipped to [-delta, delta] and gets Laplace(lambda)
noise. Neighbouring relation: two devices that differ in any of one user's ratings (user-level;
one changed rating is a special case). Any change of the user's data moves each clipped coordinate
by at most 2 delta, so each coordinate is a Laplace mechanism with L1 sensitivity 2 delta:
- per coordinate of one upload: epsilon = 2 delta / lambda (pure DP; the paper's figure);
- per upload of C coordinates: all C may change together, so one upload composes C such mechanisms;
- per user over a run: a user that uploads k times composes k C mechanisms.
With the popularity-matched pseudo-item sampler every user also sends, once, a report of one
randomised bit per catalogue item (`fedrec_flwr.privacy.popularity`), each bit eps_pop-DP: adding or
removing one rating changes one bit and costs eps_pop; a user's whole rating set can change every
bit, so the per-user total composes them with the uploads (randomised response is the worst case of
an eps-DP bit, so the accountant's randomised-response event bounds it).
"Basic" is the sum of the epsilons (pure DP). "Tight" is the Renyi-DP accountant of the
`dp-accounting` library over the same Laplace mechanisms, converted to (epsilon, delta)-DP at the
stated delta (or the basic sum where that is smaller). Neither counts the anonymity set itself (the item ids a user
registers are sent in the clear) or the number of uploads, which the server sees.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def epsilon_per_coordinate(clip_delta: float, noise_lambda: float) -> float:
    """Pure-DP epsilon of one clipped, Laplace-noised coordinate: sensitivity 2 delta over scale lambda."""
    return 2.0 * clip_delta / noise_lambda


@lru_cache(maxsize=256)
def tight_epsilon(clip_delta: float, noise_lambda: float, mechanisms: int, delta: float,
                  report_bits: int = 0, report_epsilon: float = 0.0) -> float:
    """(epsilon, delta)-DP of `mechanisms` composed coordinate mechanisms (and `report_bits` randomised-response
    bits at `report_epsilon`): dp-accounting's RDP bound, or the basic (pure) sum where that is smaller (a few
    mechanisms: RDP's conversion to delta costs more there)."""
    basic = mechanisms * epsilon_per_coordinate(clip_delta, noise_lambda) + report_bits * report_epsilon
    if basic <= 0:
        return 0.0
    # imported here: dp-accounting takes ~2 s to import, and every simulated ClientApp process imports
    # this module (for epsilon_per_coordinate) but never accounts
    import dp_accounting
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    if mechanisms > 0:
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.LaplaceDpEvent(noise_lambda / (2.0 * clip_delta)), mechanisms))
    if report_bits > 0:
        flip = 2.0 / (1.0 + float(np.exp(report_epsilon)))  # binary randomised response at report_epsilon
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.RandomizedResponseDpEvent(flip, 2),
                                                             report_bits))
    return min(float(accountant.get_epsilon(delta)), basic)


def budget(clip_delta: float, noise_lambda: float, coordinates: np.ndarray, uploads: np.ndarray, delta: float,
           report_bits: int = 0, report_epsilon: float = 0.0) -> dict:
    """The accounted budget of a run: per coordinate, per upload and per user (max and median).

    `coordinates[u]` is how many values user u's upload carries; `uploads[u]` how often it uploaded;
    `report_bits` > 0: every user also sent one popularity report of that many bits at `report_epsilon`.
    """
    eps = epsilon_per_coordinate(clip_delta, noise_lambda)
    coordinates = np.asarray(coordinates, np.int64)
    uploads = np.asarray(uploads, np.int64)
    per_run = coordinates * uploads
    order = np.argsort(per_run, kind="stable")
    median_user, max_user = order[(len(order) - 1) // 2], order[-1]
    upload_c = int(coordinates.max()) if coordinates.size else 0

    at_n = 1.0 / max(len(coordinates), 1)  # delta = 1/N, the other delta every run reports

    def run_of(u: int) -> dict:
        m = int(per_run[u])
        return {"uploads": int(uploads[u]), "basic": eps * m + report_bits * report_epsilon,
                "tight": tight_epsilon(clip_delta, noise_lambda, m, delta, report_bits, report_epsilon),
                "tight_at_1_over_n": {"delta": at_n, "epsilon": tight_epsilon(clip_delta, noise_lambda, m, at_n,
                                                                              report_bits, report_epsilon)}}

    return {
        "mode": "ldp",
        "neighbouring": "user-level: any change to one user's ratings",
        "delta": delta,
        "epsilon_per_coordinate_per_upload": eps,
        "per_upload": {"coordinates": upload_c, "basic": eps * upload_c,
                       "tight": tight_epsilon(clip_delta, noise_lambda, upload_c, delta)},
        "per_user_run": {"max": run_of(int(max_user)), "median": run_of(int(median_user))},
        **({"popularity_report": {"bits": report_bits, "epsilon_per_rating": report_epsilon,
                                  "per_user_basic": report_bits * report_epsilon,
                                  "per_user_tight": tight_epsilon(clip_delta, noise_lambda, 0, delta, report_bits,
                                                                  report_epsilon)}} if report_bits else {}),
    }


class LDPAccountant:
    """The privacy ledger of one FedGNN run, in the style of dp-accounting's accountants: it records each
    user's privacy events as they happen (an upload of C clipped, noised coordinates; the one popularity
    report of the matched sampler) and gives the budget spent on demand. Its state goes with the server's
    checkpoint, so a resumed run keeps counting where the killed one stopped."""

    def __init__(self, num_users: int, clip_delta: float, noise_lambda: float, delta: float, ldp: bool = True,
                 report_bits: int = 0, report_epsilon: float = 0.0):
        self.clip_delta, self.noise_lambda, self.delta, self.ldp = clip_delta, noise_lambda, delta, ldp
        self.report_bits, self.report_epsilon = report_bits, report_epsilon
        self.uploads = np.zeros(num_users, np.int64)  # per user: uploads received

    @classmethod
    def from_privacy(cls, num_users: int, privacy, num_items: int) -> "LDPAccountant":
        """The accountant of a run's `privacy` section (the popularity report has one bit per catalogue item)."""
        report_bits = num_items if privacy.pseudo_sampler == "popularity" else 0
        return cls(num_users, privacy.clip_delta, privacy.noise_lambda, privacy.delta, privacy.ldp, report_bits,
                   privacy.popularity_epsilon)

    def record_upload(self, user: int) -> None:
        """One upload of `user` reached the server (accepted or not: it was sent, so it was spent)."""
        self.uploads[user] += 1

    def upload_counts(self, users: list[int]) -> dict[str, float]:
        """How often `users` uploaded: max, median, and the run's total."""
        counts = self.uploads[users] if users else np.zeros(1, np.int64)
        return {"max": int(counts.max()), "median": float(np.median(counts)), "total": int(self.uploads.sum())}

    def budget(self, coordinates: dict[int, int]) -> dict | None:
        """The budget spent so far by the users of `coordinates` (user -> values its upload carries), per
        coordinate, per upload and per user over the run (`budget`); None without LDP or users."""
        if not self.ldp or not coordinates:
            return None
        users = sorted(coordinates)
        return budget(self.clip_delta, self.noise_lambda, np.array([coordinates[u] for u in users], np.int64),
                      self.uploads[users], self.delta, self.report_bits, self.report_epsilon)

    def state(self) -> dict:
        """What a checkpoint keeps of the ledger."""
        return {"uploads": self.uploads.tolist()}

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's ledger; ValueError if it is another run's (another number of users)."""
        uploads = np.asarray(state["uploads"], np.int64)
        if uploads.shape != self.uploads.shape:
            raise ValueError(f"checkpoint holds upload counts of {uploads.size} users, this run has "
                             f"{self.uploads.size}")
        self.uploads = uploads


def _quiet_absl() -> None:
    """dp-accounting warns (through absl) for each fractional RDP order whose series it drops; dropping an order
    only loosens the bound, so those lines are noise in a run's log."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


def sample_rate(clients_per_round: int, num_users: int) -> float:
    """q: the probability with which each user samples itself into a user-DP round (expected clients_per_round)."""
    return min(1.0, clients_per_round / max(num_users, 1))


@lru_cache(maxsize=256)
def _one_round_rdp(q: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP) of one Poisson-subsampled Gaussian round, by dp-accounting's RDP accountant. Cached: the
    fractional orders' series cost about half a second, and a run asks for the same (q, sigma) every round."""
    import dp_accounting
    from dp_accounting import rdp

    _quiet_absl()
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    orders, per_round = np.array(accountant.orders, np.float64), np.array(accountant.rdp, np.float64)
    orders.flags.writeable = per_round.flags.writeable = False  # shared through the cache
    return orders, per_round


def subsampled_gaussian_epsilon(q: float, noise: dict[float, int], delta: float,
                                evaluations: dict[float, int] | None = None) -> float:
    """epsilon at `delta` of rounds of the Poisson-subsampled Gaussian (sampling rate q; `noise`: noise multiplier ->
    rounds run at it), plus `evaluations` (noise multiplier -> releases) of the plain Gaussian (every user in
    each: q = 1), add-or-remove-one-user relation (`gaussian_events_epsilon`)."""
    events = {(q, sigma): n for sigma, n in noise.items()}
    for sigma, n in (evaluations or {}).items():
        events[(1.0, sigma)] = events.get((1.0, sigma), 0) + n
    return gaussian_events_epsilon(events, delta)


def gaussian_events_epsilon(events: dict[tuple[float, float], int], delta: float) -> float:
    """epsilon at `delta` of Poisson-subsampled Gaussian releases ((sampling rate, noise multiplier) -> how many),
    add-or-remove-one-user relation. RDP composes by addition, so this is what dp-accounting's RdpAccountant gives
    for the same events (the releases at one (q, sigma) count times its one-release RDP)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    total, orders = None, None
    for (rate, sigma), releases in sorted(events.items()):
        if releases <= 0:
            continue
        if sigma <= 0:
            return float("inf")
        orders, per_round = _one_round_rdp(float(rate), float(sigma))
        total = releases * per_round if total is None else total + releases * per_round
    if total is None:
        return 0.0
    return float(rdp_privacy_accountant.compute_epsilon(orders, total, delta)[0])


def released_evaluations(rounds: int, eval_every: int) -> int:
    """How many evaluations a user-DP run of `rounds` training rounds releases: after every eval_every-th round
    and after the last one (each a noisy sum every user is in, charged to the budget)."""
    return len(evaluation_points(rounds, eval_every))


def evaluation_points(rounds: int, eval_every: int) -> list[int]:
    """The training rounds after which a run evaluates: every eval_every-th and the last."""
    return sorted({t for t in range(1, rounds + 1) if t % max(eval_every, 1) == 0} | ({rounds} if rounds else set()))


@lru_cache(maxsize=64)
def calibrate_noise_multiplier(q: float, rounds: int, target_epsilon: float, delta: float, evaluations: int = 0,
                               eval_noise_multiplier: float = 0.0) -> float:
    """The smallest noise multiplier sigma whose `rounds` Poisson-subsampled Gaussian rounds at rate q, beside
    `evaluations` Gaussian releases at `eval_noise_multiplier`, spend at most `target_epsilon` at `delta`
    (dp-accounting's calibration by bisection on the RDP accountant). Deterministic, so the server and every device
    compute the same sigma from the run's config. ValueError when the evaluations alone spend the target."""
    import dp_accounting
    from dp_accounting import mechanism_calibration, rdp

    _quiet_absl()
    evals = (dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(eval_noise_multiplier), evaluations)
             if evaluations else None)
    if evals is not None:
        alone = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        if alone.compose(evals).get_epsilon(delta) >= target_epsilon:
            raise ValueError(f"{evaluations} evaluations at noise multiplier {eval_noise_multiplier:g} alone spend the "
                             f"target epsilon {target_epsilon:g}; raise privacy.eval_noise_multiplier or eval_every")

    def event(sigma: float):
        train = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)
        return train if evals is None else dp_accounting.ComposedDpEvent([train, evals])

    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE), event,
        target_epsilon, delta, mechanism_calibration.LowerEndpointAndGuess(0.05, 1.0), tol=1e-4))


def run_eval_noise_multiplier(privacy, rounds: int, eval_every: int) -> float:
    """sigma_e of a user-DP run's released evaluations: privacy.eval_noise_multiplier, or (when 0) the smallest whose
    planned evaluations (`released_evaluations`) alone spend privacy.eval_budget_share of privacy.target_epsilon at
    privacy.delta (dp-accounting's calibration). Deterministic: the server and every device compute the same."""
    if privacy.eval_noise_multiplier > 0:
        return float(privacy.eval_noise_multiplier)
    return _calibrated_gaussian(released_evaluations(rounds, eval_every),
                                float(privacy.eval_budget_share) * float(privacy.target_epsilon), float(privacy.delta))


def gaussian_releases_sigma(releases: int, epsilon: float, delta: float = 1e-5) -> float:
    """The noise multiplier of `releases` Gaussian releases (no subsampling: every user in each) that together spend
    `epsilon` at `delta`, add or remove one user (RDP, dp-accounting's calibration): the released evaluations' sigma,
    and what a benchmark of one-shot releases calibrates to."""
    return _calibrated_gaussian(releases, float(epsilon), float(delta))


@lru_cache(maxsize=64)
def _calibrated_gaussian(releases: int, epsilon: float, delta: float) -> float:
    import dp_accounting
    from dp_accounting import mechanism_calibration, rdp

    _quiet_absl()
    if releases <= 0 or epsilon <= 0:
        raise ValueError(f"no budget to calibrate {releases} evaluations to (epsilon {epsilon:g})")
    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
        lambda s: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(s), releases), epsilon, delta,
        mechanism_calibration.LowerEndpointAndGuess(0.05, 1.0), tol=1e-4))


def run_noise_multiplier(privacy, clients_per_round: int, num_users: int, rounds: int, eval_every: int) -> float:
    """sigma of a user-DP run: privacy.noise_multiplier, or (when 0) calibrated so that `rounds` training rounds and
    the evaluations released every `eval_every` of them (at `run_eval_noise_multiplier`) spend
    privacy.target_epsilon at privacy.delta."""
    if privacy.noise_multiplier > 0:
        return float(privacy.noise_multiplier)
    return calibrate_noise_multiplier(sample_rate(clients_per_round, num_users), rounds, float(privacy.target_epsilon),
                                      float(privacy.delta), released_evaluations(rounds, eval_every),
                                      run_eval_noise_multiplier(privacy, rounds, eval_every))


class UserDPAccountant:
    """The user-level ledger of a `privacy.mode = user_dp` run.

    Mechanism per training round: every user samples itself with probability q (Poisson sampling; the server
    never learns who), clips its whole update to L2 norm C, and the sum over the sampled users gets Gaussian
    noise from the nodes' shares: each node's share is sized for the noise floor (K nodes), so a sum of k >= K
    nodes carries sigma sqrt(k / K) C, at least the run's sigma C, and each round is charged at the noise it
    actually carries (`device_policy.charged_multiplier`). Neighbouring relation: add or remove one user with
    all its ratings.
    dp-accounting's RDP accountant composes the rounds; epsilon is reported at the run's delta and at 1/N.
    """

    def __init__(self, num_users: int, q: float, noise_multiplier: float, clip_norm: float, delta: float,
                 target_epsilon: float = 0.0, eval_noise_multiplier: float = 0.0, eval_every: int = 0):
        self.num_users, self.q, self.sigma, self.clip_norm = num_users, q, noise_multiplier, clip_norm
        self.delta, self.target_epsilon = delta, target_epsilon
        self.eval_sigma, self.eval_every = eval_noise_multiplier, eval_every  # released evaluations (0: none planned)
        self.noise: dict[float, int] = {}  # effective noise multiplier -> training rounds released at it
        self.evaluations: dict[float, int] = {}  # effective noise multiplier -> evaluations released at it

    @classmethod
    def from_privacy(cls, privacy, clients_per_round: int, num_users: int, rounds: int,
                     eval_every: int) -> "UserDPAccountant":
        """The accountant of a run's privacy section, with its sigma (given, or calibrated for `rounds` training rounds
        and the evaluations released every `eval_every` of them)."""
        return cls(num_users, sample_rate(clients_per_round, num_users),
                   run_noise_multiplier(privacy, clients_per_round, num_users, rounds, eval_every), privacy.clip_norm,
                   privacy.delta, privacy.target_epsilon, run_eval_noise_multiplier(privacy, rounds, eval_every),
                   eval_every)

    @property
    def rounds(self) -> int:
        """Training rounds released so far."""
        return sum(self.noise.values())

    def epsilon(self, delta: float | None = None, more_rounds: int = 0, more_evaluations: int = 0) -> float:
        """User-level epsilon spent at `delta` (default the run's), after `more_rounds` further full-noise training
        rounds and `more_evaluations` further full-noise evaluations."""
        noise, evals = dict(self.noise), dict(self.evaluations)
        if more_rounds:
            noise[self.sigma] = noise.get(self.sigma, 0) + more_rounds
        if more_evaluations:
            evals[self.eval_sigma] = evals.get(self.eval_sigma, 0) + more_evaluations
        return subsampled_gaussian_epsilon(self.q, noise, self.delta if delta is None else delta, evals)

    def _planned(self, rounds: int) -> float:
        evals = released_evaluations(rounds, self.eval_every) if self.eval_every else 0
        return self.epsilon(more_rounds=rounds, more_evaluations=evals)

    def affordable_rounds(self, planned: int) -> int:
        """How many of `planned` full-noise training rounds, with the evaluations they release, fit within
        target_epsilon (all of them with no target)."""
        if self.target_epsilon <= 0 or self._planned(planned) <= self.target_epsilon:
            return planned
        low, high = 0, planned  # epsilon grows with rounds: bisect for the last round within budget
        while low < high:
            mid = (low + high + 1) // 2
            if self._planned(mid) <= self.target_epsilon:
                low = mid
            else:
                high = mid - 1
        return low

    def record_round(self, noise_multiplier: float) -> None:
        """One released sum that carried noise of `noise_multiplier` x C (`device_policy.charged_multiplier`)."""
        sigma = round(float(noise_multiplier), 12)
        self.noise[sigma] = self.noise.get(sigma, 0) + 1

    def record_evaluation(self, noise_multiplier: float) -> None:
        """One released evaluation sum (every user in it) that carried noise of `noise_multiplier` x its clip."""
        sigma = round(float(noise_multiplier), 12)
        self.evaluations[sigma] = self.evaluations.get(sigma, 0) + 1

    def budget(self) -> dict:
        """What every user has spent so far: the same for all (each is in every round with probability q)."""
        at_n = 1.0 / max(self.num_users, 1)
        return {"mode": "user_dp", "neighbouring": "add or remove one user with all its ratings",
                "mechanism": ("Gaussian on the sum of every user's clipped update (q = 1; RDP, dp-accounting)"
                              if self.q >= 1.0 else
                              "Poisson-subsampled Gaussian on the sum of clipped user updates (RDP, dp-accounting)"),
                "sample_rate": self.q, "noise_multiplier": self.sigma, "clip_norm": self.clip_norm,
                "rounds": self.rounds, "target_epsilon": self.target_epsilon, "delta": self.delta,
                "evaluations": sum(self.evaluations.values()), "eval_noise_multiplier": self.eval_sigma,
                "epsilon": self.epsilon(), "epsilon_at_1_over_n": {"delta": at_n, "epsilon": self.epsilon(at_n)}}

    def state(self) -> dict:
        """What a checkpoint keeps of the ledger."""
        return {"user_dp_noise": [[float(s), int(r)] for s, r in sorted(self.noise.items())],
                "user_dp_evaluations": [[float(s), int(r)] for s, r in sorted(self.evaluations.items())]}

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's ledger."""
        self.noise = {float(s): int(r) for s, r in state.get("user_dp_noise", [])}
        self.evaluations = {float(s): int(r) for s, r in state.get("user_dp_evaluations", [])}

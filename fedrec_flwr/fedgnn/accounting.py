"""What FedGNN's LDP actually guarantees: per coordinate, per upload and per user over a run.

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
stated delta (or the basic sum where that is smaller). Neither counts the anonymity set itself (the item ids a user registers are sent in
the clear) or the number of uploads, which the server sees.
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
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.RandomizedResponseDpEvent(flip, 2), report_bits))
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

    def run_of(u: int) -> dict:
        m = int(per_run[u])
        return {"uploads": int(uploads[u]), "basic": eps * m + report_bits * report_epsilon,
                "tight": tight_epsilon(clip_delta, noise_lambda, m, delta, report_bits, report_epsilon)}

    return {
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
            raise ValueError(f"checkpoint holds upload counts of {uploads.size} users, this run has {self.uploads.size}")
        self.uploads = uploads

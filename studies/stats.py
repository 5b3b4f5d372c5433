"""The statistics of a report: mean and standard deviation over seeds, and the 95 % interval of a mean
(Student's t, its quantile computed for any number of values)."""
import math


def stats(values):
    """mean, sample standard deviation (n - 1; None for one value), n."""
    n = len(values)
    if not n:
        return {"mean": None, "std": None, "n": 0, "values": []}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "values": values}


def _beta_fraction(a, b, x):
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4),
    converging fast for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def incomplete_beta(a, b, x):
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t, df):
    """Student's t distribution with df degrees of freedom: Pr(T <= t)."""
    tail = 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p, df):
    """The t with Pr(T <= t) = p (0.5 <= p < 1), by bisection of t_cdf to the last bit."""
    if not (0.5 <= p < 1 and df > 0):
        raise ValueError(f"t_quantile: p={p} must be in [0.5, 1) and df={df} above 0")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    while hi - lo > 4 * math.ulp(hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def interval(values):
    """stats() with the half-width of a 95 % confidence interval of the mean (None below 2 values)."""
    s = stats(values)
    s["ci95"] = t_quantile(0.975, s["n"] - 1) * s["std"] / math.sqrt(s["n"]) if s["n"] > 1 else None
    return s


def paired(by_seed, best_by_seed):
    """by_seed's values minus best_by_seed's ({seed: value} each), over the seeds both have, as interval() gives
    them, and what they say: one seed, no common seed, inside the noise (the 95 % interval holds 0) or outside."""
    seeds = sorted(set(by_seed) & set(best_by_seed), key=int)
    d = interval([by_seed[s] - best_by_seed[s] for s in seeds])
    verdict = ("one seed" if d["n"] == 1 else "no common seed" if not d["n"]
               else "inside the noise" if abs(d["mean"]) <= d["ci95"] else "outside the noise")
    return d, verdict


def lowest_first(rows, by_seed):
    """rows by their mean value over the seeds they all have (by_seed(row): {seed: value}): a seed's data moves
    every arm's loss alike, more than arms differ, so means over different seeds (a study half done) would rank
    the seeds; each over its own seeds where they share none."""
    common = set.intersection(*(set(by_seed(r)) for r in rows)) if rows else set()
    def mean(r):
        values = by_seed(r)
        seeds = common or values
        return sum(values[s] for s in seeds) / len(seeds)
    return sorted(rows, key=mean)

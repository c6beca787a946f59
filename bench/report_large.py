"""Report generation on a synthetic large record, against pyarrow reading the same columns.

Generates (not committed) a record of 10,000 steps x 64 rollouts = 640,000 completions in a
temporary directory, then measures in separate processes, each from a cold interpreter:

* baseline: ``pyarrow.parquet.read_table`` of the columns the report reads
  (step, completion, reward, advantage) -- the floor for any reader of this record;
* read plus features: the same read, then the report's nine surface features
  (``SurfaceFeatures().compute``) -- what any tool that reads this basis must at least do;
* read plus features on threads: the same, read in batches of 65,536 rows with the features
  computed on ``in_threads`` as the report does (one thread per core, up to four) -- the
  report's threads are not what the ratio against the single-threaded baseline measures;
* ``reward-lens report`` (md, html, json) on the same record;
* with ``--tapped``, the fair baseline: everything the record holds (the rollouts and held-out
  rows with every column, their log-probability columns and token KL included, and the
  telemetry) read, and the same nine features computed on both sides' completions.

Prints wall seconds and peak resident memory of each, and the ratios, for completions of
two lengths (``--text-scales 1,4``: 8-63 characters, then four times that). The report
streams the rollouts by row group, so its peak memory should grow far less with the text
than the baseline's, which holds every completion. Options: ``--steps N --per-step M``, and
``--paired`` (the rollouts carry the log-probabilities the paired ledger prices), and
``--tapped`` (as the tap writes a record now: also the token KL ``kl_prev`` along every row,
4 held-out completions of pi_{t-1} per prompt group in ``heldout.parquet``, and D_t in the
telemetry, so every step pair is priced two-sided with its eta).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_record(path: Path, steps: int, per_step: int, scale: int = 1, paired: bool = False,
                tapped: bool = False) -> None:
    """``paired``: every rollout also carries log pi_t and log pi_{t-1} (``logp_pre``,
    ``logp_prev``, as the tap writes them; step 0 has no previous policy), with a log-ratio
    that depends on the completion's share of lower-case letters, so the paired ledger prices
    every step pair."""
    import numpy as np
    import pyarrow as pa

    from reward_lens.record import OptimizerTelemetry, write_run

    rng = np.random.default_rng(0)
    n = steps * per_step
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 .,!?\n", dtype=np.uint8)
    lengths = rng.integers(8, 64, size=n) * scale
    p_lower = np.repeat(np.linspace(0.3, 0.9, steps), per_step)
    texts = []
    for i in range(n):  # synthetic data only: a Python loop is fine in a generator
        lower = rng.random(lengths[i]) < p_lower[i]
        chars = np.where(lower, rng.integers(97, 123, lengths[i]), rng.choice(alphabet, lengths[i]))
        texts.append(bytes(chars.astype(np.uint8)).decode())
    step = np.repeat(np.arange(steps), per_step)
    table = pa.table({
        "step": pa.array(step, pa.int64()),
        "group_id": pa.array([f"{s}:{j // 8}" for s, j in zip(step, np.tile(np.arange(per_step), steps))]),
        "prompt": pa.array(["synthetic prompt"] * n),
        "completion": pa.array(texts),
        "reward": pa.array(rng.random(n)),
        "advantage": pa.array(rng.normal(size=n)),
    })
    if paired:
        frac_lower = np.array([sum(c.islower() for c in t) / len(t) for t in texts])
        logp = -rng.gamma(4.0, 12.0, size=n) * scale
        ratio = 0.02 * (frac_lower - 0.6) + rng.normal(0.0, 0.01, size=n)  # log pi_t - log pi_{t-1}
        prev = np.where(step == 0, np.nan, logp - ratio)
        table = table.append_column("logp_pre", pa.array(logp))
        table = table.append_column("logp_prev", pa.array(prev, mask=step == 0))
    heldout = None
    d_t = {}
    if tapped:  # the token KL along each row, and 4 held-out rows per prompt group of pi_{t-1}
        kl = np.abs(ratio) + rng.gamma(2.0, 0.002, size=n)
        table = table.append_column("kl_prev", pa.array(np.where(step == 0, np.nan, kl), mask=step == 0))
        table = table.append_column("logp_prev_step", pa.array(np.where(step == 0, 0, step - 1), mask=step == 0))
        within = np.tile(np.arange(per_step), steps) % 8  # position in its prompt group of 8
        held = table.filter(pa.array((step > 0) & (within < 4)))  # 4 rows per group, as if drawn from pi_{t-1}
        logp_pre = held.column("logp_pre").to_numpy()
        shift = 0.5 * (logp_pre - held.column("logp_prev").to_numpy())
        held = held.set_column(held.schema.get_field_index("logp_prev"), "logp_prev", pa.array(logp_pre - shift))
        heldout = held
        sums = np.bincount(step, weights=kl, minlength=steps) / per_step
        d_t = {s: float(sums[s + 1]) for s in range(steps - 1)}
    tel = [OptimizerTelemetry(step=s, learning_rate=1e-5, grad_norm_unclipped=1.0, kl_to_previous=d_t.get(s),
                              kl_to_previous_se=0.0001 if s in d_t else None,
                              kl_to_previous_estimator="independent_two_sided" if s in d_t else None)
           for s in range(steps)]
    write_run(path, framework={"name": "synthetic"}, model={"description": "bench"}, telemetry=tel, rollouts=table,
              heldout=heldout)


# VmHWM, the peak RSS of this process image: ru_maxrss would carry over the parent's peak
# through fork + exec (Linux folds the pre-exec high-water mark into the signal struct).
HWM_SRC = """
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""

BASELINE = """
import sys, time, json
HWM
import pyarrow.parquet as pq
t = time.perf_counter()
table = pq.read_table(sys.argv[1] + "/rollouts.parquet", columns=["step", "completion", "reward", "advantage"])
n = table.num_rows
print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": hwm(), "rows": n}))
"""

FEATURES = """
import sys, time, json
HWM
t = time.perf_counter()
import pyarrow.parquet as pq
from reward_lens.measure.ledger.features import SurfaceFeatures
table = pq.read_table(sys.argv[1] + "/rollouts.parquet", columns=["step", "completion", "reward", "advantage"])
z = SurfaceFeatures().compute(table)
print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": hwm(), "rows": len(z)}))
"""

# The fair baseline of a tapped record (issue 43): everything the record holds -- the rollouts and
# the held-out rows with every column (their log-probabilities and token KL included) and the
# telemetry -- read, and the same nine features computed on the completions of both.
FAIR = """
import sys, time, json
HWM
t = time.perf_counter()
import os
import pyarrow.parquet as pq
from reward_lens.measure.ledger.features import SurfaceFeatures
f = SurfaceFeatures()
rows = 0
for name in ("rollouts.parquet", "heldout.parquet"):
    path = os.path.join(sys.argv[1], name)
    if os.path.exists(path):
        rows += len(f.compute(pq.read_table(path)))
tel = pq.read_table(os.path.join(sys.argv[1], "telemetry.parquet"))
print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": hwm(), "rows": rows}))
"""

FEATURES_THREADED = """
import sys, time, json
HWM
t = time.perf_counter()
import pyarrow as pa
import pyarrow.parquet as pq
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.price import in_threads
pf = pq.ParquetFile(sys.argv[1] + "/rollouts.parquet")
f = SurfaceFeatures()
batches = (pa.Table.from_batches([b]) for b in pf.iter_batches(batch_size=65536,
           columns=["step", "completion", "reward", "advantage"]))
n = sum(len(z) for _, z in in_threads(batches, f.compute))
print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": hwm(), "rows": n}))
"""

REPORT = """
import sys, time, json
HWM
t = time.perf_counter()
from reward_lens.cli import main
code = main(["report", sys.argv[1], "--out", sys.argv[2], "--quiet", "--fail-on", "never"])
print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": hwm(), "code": code}))
"""

IMPORTS = """
import time, json
HWM
t = time.perf_counter()
import reward_lens.cli, reward_lens.report.render, reward_lens.report.build, reward_lens.report.plots
print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": hwm()}))
"""


# Every process runs on byte-compiled modules, as an installed package does (pip compiles them):
# where PYTHONDONTWRITEBYTECODE is set, each process would otherwise compile reward-lens from
# source, and the report imports more of it than the baselines do.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure(code: str, *args: str) -> dict:
    code = code.replace("HWM\n", HWM_SRC)
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=REPO,
                         env=ENV)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--per-step", type=int, default=64)
    ap.add_argument("--text-scales", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paired", action="store_true", help="rollouts carry logp_pre and logp_prev: the paired ledger")
    ap.add_argument("--tapped", action="store_true", help="as the tap records now: --paired plus kl_prev, held-out "
                    "completions and D_t (two-sided paired ledger with eta on every step pair)")
    ap.add_argument("--save", action="store_true", help="also write the output to bench/results/report_large"
                    "[_paired|_tapped].txt (docs/benchmarks.md quotes it: tools/bench_quotes.py)")
    a = ap.parse_args()
    if a.save:
        name = "report_large" + ("_tapped" if a.tapped else "_paired" if a.paired else "") + ".txt"
        with saved_to(REPO / "bench" / "results" / name):
            run(a)
    else:
        run(a)


@contextlib.contextmanager
def saved_to(path: Path):
    """Everything printed inside, also written to ``path`` when the block ends."""
    out = io.StringIO()

    class Both(io.TextIOBase):
        def write(self, text: str) -> int:
            sys.__stdout__.write(text)
            sys.__stdout__.flush()
            return out.write(text)

    with contextlib.redirect_stdout(Both()):
        yield
    path.parent.mkdir(exist_ok=True)
    path.write_text(out.getvalue().strip() + "\n")


def run(a) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", "reward_lens", "reward_lens_spec"], check=True, cwd=REPO,
                   env=ENV)
    imports = measure(IMPORTS)
    print(f"reward-lens imports alone: {imports['seconds']:.2f} s, peak RSS {imports['rss_mib']:.0f} MiB")
    for scale in [int(x) for x in a.text_scales.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            rec = Path(tmp) / "record"
            t = time.perf_counter()
            make_record(rec, a.steps, a.per_step, scale, paired=a.paired or a.tapped, tapped=a.tapped)
            generated = time.perf_counter() - t
            size = sum(p.stat().st_size for p in rec.iterdir() if p.is_file()) / 2**20
            runs = []
            for r in range(a.repeats):  # interleaved: each round measures all of them
                runs.append((measure(BASELINE, str(rec)), measure(FEATURES, str(rec)),
                             measure(REPORT, str(rec), str(Path(tmp) / f"out{r}")), measure(FEATURES_THREADED, str(rec)),
                             *([measure(FAIR, str(rec))] if a.tapped else [])))
            width = len(runs[0])
            base, feat, rep, thr, *fair = ({key: statistics.median(x[i][key] for x in runs) for key in ("seconds", "rss_mib")}
                                           for i in range(width))
            ranges = {i: (min(x[i]["seconds"] for x in runs), max(x[i]["seconds"] for x in runs)) for i in range(width)}
            outs = {p.name: p.stat().st_size / 2**20 for p in (Path(tmp) / "out0").iterdir()}
        kind = ", tapped (two-sided paired)" if a.tapped else ", paired" if a.paired else ""
        print(f"\ntext x{scale}{kind}: {a.steps} steps x {a.per_step} rollouts, {size:.0f} MiB on disk "
              f"(generated in {generated:.0f} s)")
        print(f"  medians of {a.repeats} interleaved rounds (range of seconds in brackets)")
        print(f"  pyarrow read of the same columns: {base['seconds']:.2f} s {ranges[0][0]:.2f}-{ranges[0][1]:.2f}, "
              f"peak RSS {base['rss_mib']:.0f} MiB")
        print(f"  the same read plus the report's nine features (imports included): {feat['seconds']:.2f} s "
              f"{ranges[1][0]:.2f}-{ranges[1][1]:.2f}, peak RSS {feat['rss_mib']:.0f} MiB")
        print(f"  the same with the features on threads, as the report computes them: {thr['seconds']:.2f} s "
              f"{ranges[3][0]:.2f}-{ranges[3][1]:.2f}, peak RSS {thr['rss_mib']:.0f} MiB")
        if fair:
            print(f"  everything the record holds (rollouts and held-out rows, every column, and the telemetry) plus "
                  f"the nine features: {fair[0]['seconds']:.2f} s {ranges[4][0]:.2f}-{ranges[4][1]:.2f}, "
                  f"peak RSS {fair[0]['rss_mib']:.0f} MiB")
        print(f"  reward-lens report (md,html,json): {rep['seconds']:.2f} s {ranges[2][0]:.2f}-{ranges[2][1]:.2f}, "
              f"peak RSS {rep['rss_mib']:.0f} MiB")
        print(f"  ratio report / pyarrow read: time {rep['seconds'] / base['seconds']:.1f}x, "
              f"peak memory {rep['rss_mib'] / base['rss_mib']:.2f}x")
        paired = sorted(x[2]["seconds"] / x[1]["seconds"] for x in runs)  # each round's own ratio
        print(f"  ratio report / read plus features (issue 14's baseline; target 1.3x): time "
              f"{rep['seconds'] / feat['seconds']:.2f}x (round by round: median {statistics.median(paired):.2f}x, "
              f"{paired[0]:.2f}-{paired[-1]:.2f}), peak memory {rep['rss_mib'] / feat['rss_mib']:.2f}x")
        print(f"  ratio report / read plus features on threads: time {rep['seconds'] / thr['seconds']:.2f}x, "
              f"peak memory {rep['rss_mib'] / thr['rss_mib']:.2f}x")
        if fair:
            own = sorted(x[2]["seconds"] / x[4]["seconds"] for x in runs)
            print(f"  ratio report / everything the record holds plus features: time "
                  f"{rep['seconds'] / fair[0]['seconds']:.2f}x (round by round: median {statistics.median(own):.2f}x, "
                  f"{own[0]:.2f}-{own[-1]:.2f}), peak memory {rep['rss_mib'] / fair[0]['rss_mib']:.2f}x")
        print("  outputs: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in sorted(outs.items())))


if __name__ == "__main__":
    main()

"""Which findings a finished TRL run supports without the tap, with and without completions
logged: the audit of two GRPO configurations (``log_completions`` false and true), the same
resolution ``reward-lens check`` applies to a TRL output directory. docs/findings.md quotes it
(a test keeps the quote equal to this script's output).

    python tools/trl_findings.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

BASE = "num_generations: 8\nper_device_train_batch_size: 16\nlogging_steps: 1\nmax_steps: 100\n"  # 2 prompt groups a step


def supported(log_completions: bool) -> tuple[list[str], list[str], int]:
    """The findings the audit says will evaluate, those it says will not, and how many there are."""
    from reward_lens.audit import audit

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "grpo.yaml"
        cfg.write_text(BASE + f"log_completions: {str(log_completions).lower()}\n")
        found = audit(cfg, framework="trl").findings
    return ([f.finding for f in found if f.verdict == "will evaluate"],
            sorted({m for f in found if f.verdict != "will evaluate" for m in f.missing}), len(found))


def _codes(names: list[str]) -> str:
    names = [f"`{n}`" if n.isidentifier() else n for n in names]  # a field name, or what a field would not say
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def text() -> str:
    plain, lack, n = supported(False)
    logged, lack_logged, _ = supported(True)
    more = [f for f in logged if f not in plain]
    return (f"Without completions (`log_completions=False`), TRL's logged scalars support {len(plain)} of the {n} "
            f"findings: {_codes(plain)}. With completions logged (`log_completions=True`), {len(logged)}: also "
            f"{_codes(more)}, which read the rollouts. The rest are not evaluated, and name what "
            f"they need: {_codes(lack_logged)}.")


if __name__ == "__main__":
    print(text())

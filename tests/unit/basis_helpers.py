"""Callables a test basis names as `module:function` (vectorised over a pyarrow array)."""

import numpy as np
import pyarrow.compute as pc


def vowels(completions):
    return pc.count_substring_regex(completions, pattern="[aeiou]").to_numpy(zero_copy_only=False)


def too_short(completions):
    return np.zeros(len(completions) - 1)


def not_finite(completions):
    return np.full(len(completions), np.nan)


def raises_runtime(completions):
    raise RuntimeError("the user's bug")


def raises_key(completions):
    return {}["missing"]


def exits(completions):
    import sys

    sys.exit(0)


def never_returns(completions):
    import time

    while True:  # a user's function that hangs (issue 61 item 4)
        time.sleep(0.05)


def slow_vowels(completions):
    import time

    time.sleep(0.3)
    return vowels(completions)
